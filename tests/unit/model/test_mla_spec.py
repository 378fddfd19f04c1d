"""How a DeepSeek-V3 config.json reads: the MLA shape, the pool row, YaRN and its scales, and
what is refused. The numbers are DeepSeek-V3's own config (its attention and rope fields)."""

from __future__ import annotations

import math

import pytest

from prefill_worker.model.hf_config import spec_from_dict
from prefill_worker.model.layers import rope_attention_factor

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
}  # fmt: skip


def test_deepseek_v3_reads_as_mla_with_one_latent_row_per_token():
    spec = spec_from_dict(DEEPSEEK_V3)
    assert spec.family == "deepseek_v3" and spec.mla is not None and spec.moe is not None
    assert (spec.num_kv_heads, spec.head_dim) == (1, 576)  # the pool row: 512 + 64
    assert spec.mla.q_lora_rank == 1536 and spec.mla.qk_head_dim == 192
    assert spec.moe.sparse_layers == frozenset(range(3, 61))
    mscale = 0.1 * math.log(40) + 1
    assert spec.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert rope_attention_factor(spec.rope) == 1.0  # mscale == mscale_all_dim


def test_yarn_without_factor_and_with_unequal_mscales():
    rope = {"type": "yarn", "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 0.5}  # fmt: skip
    spec = spec_from_dict({**DEEPSEEK_V3, "rope_scaling": rope, "q_lora_rank": None})
    assert spec.rope.factor == 40.0 and spec.mla is not None and spec.mla.q_lora_rank is None
    expected = (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1)
    assert rope_attention_factor(spec.rope) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "not supported"),
        ({"scoring_func": "softmax"}, "scoring_func"),
    ],
)
def test_what_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        spec_from_dict({**DEEPSEEK_V3, **change})
