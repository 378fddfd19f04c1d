"""How a hybrid config.json reads (Qwen3-Next-80B-A3B's and Qwen3.5's fields): which layers
are linear, their heads, the rotary part, the state a slot holds, and what is refused."""

from __future__ import annotations

import pytest

from prefill_worker.model.hf_config import spec_from_dict

QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "vocab_size": 151936,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "max_position_embeddings": 262144,
    "dtype": "bfloat16",
}


def test_qwen3_next_80b() -> None:
    spec = spec_from_dict(QWEN3_NEXT_80B)
    lin = spec.linear
    assert lin is not None and spec.family == "qwen3_next" and spec.has_qk_norm
    assert lin.full_layers == tuple(range(3, 48, 4)) and len(lin.linear_layers) == 36
    assert (lin.key_dim, lin.value_dim, lin.conv_dim, lin.rotary_dim) == (2048, 4096, 8192, 64)
    assert lin.qkvz_grouped
    # 36 layers x (8192 x 3 bf16 + 32 x 128 x 128 fp32) = 36 x 2 145 728 bytes: ~73.7 MiB
    assert lin.slot_bytes(2) == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4) == 77_266_944
    moe = spec.moe
    assert moe is not None and moe.shared_expert_size == 512 and moe.num_shared_experts == 0
    assert len(moe.sparse_layers) == 48 and moe.norm_topk_prob


def test_qwen3_5_layer_types_and_moe_defaults() -> None:
    kinds = ["linear_attention", "full_attention"] * 2
    dense = dict(QWEN3_NEXT_80B, architectures=["Qwen3_5ForCausalLM"], layer_types=kinds)
    dense |= {"num_hidden_layers": 4, "model_type": "qwen3_5_text"}
    spec = spec_from_dict(dense)
    assert spec.moe is None and spec.linear is not None and not spec.linear.qkvz_grouped
    assert (spec.linear.full_layers, spec.linear.linear_layers) == ((1, 3), (0, 2))
    moe = {k: v for k, v in dense.items() if k not in ("intermediate_size", "norm_topk_prob")}
    moe |= {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"}
    spec = spec_from_dict(moe)
    assert spec.moe is not None and spec.moe.norm_topk_prob  # its router always renormalises
    assert spec.intermediate_size == 512 and spec.moe.sparse_layers == frozenset(range(4))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["full_attention"] * 3}, "layer_types names 3 layers; the model has 48"),
        ({"layer_types": ["sliding_attention"] * 48}, "layer_types ['sliding_attention']"),
        ({"linear_num_value_heads": 24, "linear_num_key_heads": 16}, "do not group over 16"),
        ({"linear_conv_kernel_dim": 1}, "conv kernel 1"),
    ],
)
def test_what_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec_from_dict(QWEN3_NEXT_80B | change)
