"""How config.json's MoE fields read: which layers are sparse, and the router's settings."""

from __future__ import annotations

import pytest

from prefill_worker.model.hf_config import moe_spec, spec_from_dict

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}


def test_qwen3_moe_every_layer_sparse_by_default():
    spec = spec_from_dict(QWEN3_30B_A3B)
    assert spec.family == "qwen3_moe" and spec.has_qk_norm and spec.moe is not None
    assert spec.moe.sparse_layers == frozenset(range(48))
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.scoring) == (128, 8, "softmax")


def test_qwen3_moe_dense_layers_by_step_and_list():
    raw = QWEN3_30B_A3B | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = spec_from_dict(raw)
    assert [spec.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


def test_deepseek_v3_first_dense_layers_and_grouped_routing():
    spec = moe_spec(DEEPSEEK_V3)
    assert spec.sparse_layers == frozenset(range(3, 61))
    assert (spec.n_group, spec.topk_group, spec.num_shared_experts) == (8, 4, 1)
    assert spec.has_score_bias and spec.routed_scaling_factor == 2.5
    every_other = moe_spec(DEEPSEEK_V3 | {"num_hidden_layers": 8, "moe_layer_freq": 2})
    assert every_other.sparse_layers == frozenset({4, 6})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 300}, "num_experts_per_tok 300"),
        ({"n_group": 7}, "do not split into 7 groups"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ],
)
def test_bad_moe_fields_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        moe_spec(DEEPSEEK_V3 | change)
