"""The head-slice rule, the split tables and the KV reassembly (no processes, no checkpoint)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prefill_worker.model.hf_config import spec_from_dict
from prefill_worker.model.loader import expected_shapes
from prefill_worker.model.parallel import (
    TPGroup,
    gather_kv_heads,
    kv_head_range,
    q_head_range,
)
from prefill_worker.model.sharding import (
    FAMILY_SPLITS,
    REPLICATED,
    LocalDims,
    check_model_shardable,
    local_dims,
    local_linear,
    local_shape,
    shard_slice,
    shard_slices,
    split_of,
)


def ranks(num_kv_heads: int, size: int) -> list[list[int]]:
    return [list(kv_head_range(num_kv_heads, TPGroup(r, size))) for r in range(size)]


def test_kv_heads_split_when_there_are_enough():
    assert ranks(8, 1) == [list(range(8))]
    assert ranks(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ranks(8, 8) == [[h] for h in range(8)]


def test_kv_heads_replicated_on_consecutive_ranks_when_fewer_than_ranks():
    assert ranks(2, 4) == [[0], [0], [1], [1]]
    assert ranks(1, 2) == [[0], [0]]
    assert ranks(2, 8) == [[0]] * 4 + [[1]] * 4


@pytest.mark.parametrize(("num_kv_heads", "size"), [(3, 2), (2, 3), (6, 4)])
def test_kv_heads_that_do_not_divide_are_refused(num_kv_heads, size):
    with pytest.raises(ValueError, match="KV heads"):
        kv_head_range(num_kv_heads, TPGroup(0, size))


def test_query_heads_fall_in_the_group_of_the_ranks_kv_head():
    """Rank r's query heads h all use KV head h // (H / KV), which rank r holds."""
    shapes = [(32, 8, 4), (32, 8, 16), (4, 1, 2), (28, 4, 4), (64, 8, 16)]  # H, KV, TP
    for num_heads, num_kv_heads, size in shapes:
        for rank in range(size):
            tp = TPGroup(rank, size)
            group = num_heads // num_kv_heads
            wanted = {h // group for h in q_head_range(num_heads, tp)}
            assert wanted <= set(kv_head_range(num_kv_heads, tp)), (num_heads, rank)


def test_a_rank_outside_its_group_is_refused():
    with pytest.raises(ValueError):
        TPGroup(2, 2)


DEEPSEEK = {
    "model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 12, "attention_bias": False,
}  # fmt: skip

# A hybrid (gated DeltaNet + full attention): 2 key heads of 6, 6 value heads of 4, kernel 4.
HYBRID = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 6,
    "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention"],
}  # fmt: skip


def full_spec(family: str, **overrides: object):  # type: ignore[no-untyped-def]
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    arch["qwen3_moe"] = "Qwen3MoeForCausalLM"
    arch["deepseek_v3"] = "DeepseekV3ForCausalLM"
    arch |= {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}
    arch["qwen3_5_moe"] = "Qwen3_5MoeForCausalLM"
    arch |= {"gpt_oss": "GptOssForCausalLM", "gemma3": "Gemma3ForCausalLM"}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    hybrid = dict(HYBRID, shared_expert_intermediate_size=8 if family != "qwen3_5" else 0)
    hybrid |= moe if family != "qwen3_5" else {}
    extra = {"qwen3_moe": moe, "deepseek_v3": DEEPSEEK}.get(family, {})
    extra = hybrid if family.startswith(("qwen3_next", "qwen3_5")) else extra
    sliding = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    if family == "gpt_oss":
        extra = dict(sliding, num_local_experts=4, num_experts_per_tok=2)
    if family == "gemma3":
        extra = sliding
    arch |= {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
    if family in ("deepseek_v32", "glm_moe_dsa"):
        index = {"index_topk": 4, "index_head_dim": 8, "index_n_heads": 2}
        extra = dict(DEEPSEEK, model_type=family, **index)
    return spec_from_dict(
        {
            **extra,
            "mlp_only_layers": [1],
            "architectures": [arch[family]],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 320,
            "attention_bias": True,
            "mlp_bias": True,
            **extra,
            **overrides,
        }
    )


@pytest.mark.parametrize("family", sorted(FAMILY_SPLITS))
def test_every_tensor_a_family_loads_has_a_split(family):
    for name in expected_shapes(full_spec(family)):
        split_of(family, name)  # raises KeyError when the table is silent


def test_expert_weights_split_per_expert_and_the_router_is_replicated():
    spec, tp = full_spec("qwen3_moe"), TPGroup(1, 2)  # moe_intermediate_size 16
    expert = "model.layers.0.mlp.experts.3."
    assert shard_slice(spec, expert + "gate_proj.weight", (16, 64), tp) == slice(8, 16)
    assert local_shape(spec, expert + "up_proj.weight", (16, 64), tp) == (8, 64)
    assert local_shape(spec, expert + "down_proj.weight", (64, 16), tp) == (64, 8)
    assert split_of("qwen3_moe", "model.layers.0.mlp.gate.weight") == REPLICATED


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_splits_the_heads_and_replicates_the_latent(q_lora_rank):
    """4 heads over 2 ranks: rank 1 holds heads 2-3 of q_b (or q_proj) and kv_b, their o
    columns; the latent's projection and norm are whole on every rank."""
    spec, tp = full_spec("deepseek_v3", q_lora_rank=q_lora_rank), TPGroup(1, 2)
    attn = "model.layers.1.self_attn."
    shapes = expected_shapes(spec)
    q_name = attn + ("q_b_proj.weight" if q_lora_rank else "q_proj.weight")
    assert local_shape(spec, q_name, shapes[q_name], tp) == (2 * 12, shapes[q_name][1])
    assert shard_slice(spec, q_name, shapes[q_name], tp) == slice(24, 48)  # nope 8 + rope 4
    kv_b = attn + "kv_b_proj.weight"  # [4 (8 + 12), 16]
    assert shard_slice(spec, kv_b, shapes[kv_b], tp) == slice(40, 80)
    o = attn + "o_proj.weight"  # [64, 4 * 12]
    assert local_shape(spec, o, shapes[o], tp) == (64, 24)
    for replicated in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert (
            local_shape(spec, attn + replicated, shapes[attn + replicated], tp)
            == (shapes[attn + replicated])
        )
    assert local_dims(spec, tp) == LocalDims(2, 1, 64)  # one latent "head" on every rank


def test_a_tensor_the_table_does_not_name_is_an_error():
    with pytest.raises(KeyError, match=r"mlp\.experts\.3\.gate_proj"):
        split_of("llama", "model.layers.0.mlp.experts.3.gate_proj.weight")


def test_slices_of_each_kind():
    spec, tp = full_spec("qwen3"), TPGroup(1, 2)  # 4 heads, 2 KV heads, head_dim 32, I 128
    layer = "model.layers.1."
    assert shard_slice(spec, layer + "self_attn.q_proj.weight", (128, 64), tp) == slice(64, 128)
    assert shard_slice(spec, layer + "self_attn.k_proj.bias", (64,), tp) == slice(32, 64)
    assert shard_slice(spec, layer + "self_attn.o_proj.weight", (64, 128), tp) == slice(64, 128)
    assert local_shape(spec, layer + "mlp.down_proj.weight", (64, 128), tp) == (64, 64)
    assert local_shape(spec, layer + "mlp.up_proj.weight", (128, 64), tp) == (64, 64)
    assert split_of("qwen3", layer + "self_attn.q_norm.weight") == REPLICATED
    assert local_dims(spec, TPGroup(3, 4)) == LocalDims(1, 1, 32)


def test_gather_kv_heads_reassembles_and_checks_replicas():
    full = torch.randn(5, 2, 3)  # [T, KV, D]
    split = [full[:, r : r + 1] for r in range(2)]
    assert torch.equal(gather_kv_heads(split, 2), full)
    replicated = [full[:, h : h + 1] for h in (0, 0, 1, 1)]  # TP 4 holds 2 KV heads twice
    assert torch.equal(gather_kv_heads(replicated, 2), full)
    with pytest.raises(ValueError, match="replica differs"):
        gather_kv_heads([full[:, 0:1], full[:, 0:1] + 1, full[:, 1:2], full[:, 1:2]], 2)
    with pytest.raises(ValueError, match="holds 2 KV heads, not 1"):
        gather_kv_heads([full, full], 2)


def test_a_gated_delta_net_splits_by_heads_its_qkv_channels_in_three_runs():
    """Key dim 12 (2 heads of 6), value dim 24: rank 1 of 2 holds the second key head's q
    and k channels and the last three value heads' v channels, concatenated."""
    spec, tp = full_spec("qwen3_5"), TPGroup(1, 2)
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert shard_slices(spec, conv, (48, 1, 4), tp) == (slice(6, 12), slice(18, 24), slice(36, 48))
    assert local_shape(spec, conv, (48, 1, 4), tp) == (24, 1, 4)
    assert local_shape(spec, "model.layers.0.linear_attn.out_proj.weight", (64, 24), tp) == (64, 12)
    with pytest.raises(ValueError, match="three runs"):
        shard_slice(spec, conv, (48, 1, 4), tp)
    assert local_linear(spec.linear, tp) == replace(spec.linear, num_k_heads=1, num_v_heads=3)


def test_key_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="2 linear-attention key heads do not split over 4"):
        check_model_shardable(full_spec("qwen3_next"), TPGroup(0, 4))
