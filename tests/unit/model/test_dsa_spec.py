"""The DSA families' configs read into the spec: DeepSeek-V3.2-Exp's shape (MLA, 256 experts,
an indexer of 64 heads of 128 choosing 2048 keys, FP8 blocks), GLM-5's per-layer indexer
kinds in each form transformers accepts, the indexer tensors the loader expects, and what is
refused."""

from __future__ import annotations

import pytest

from prefill_worker.model.dsa_loader import indexer_shapes
from prefill_worker.model.hf_config import spec_from_dict
from prefill_worker.model.hf_dsa import FULL, SHARED
from prefill_worker.model.loader import expected_shapes
from prefill_worker.model.parallel import TPGroup
from prefill_worker.model.sharding import REPLICATED, check_model_shardable, split_of

DEEPSEEK_V32_EXP = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip


def glm(**fields: object) -> dict[str, object]:
    return dict(DEEPSEEK_V32_EXP, architectures=["GlmMoeDsaForCausalLM"],
                model_type="glm_moe_dsa", num_hidden_layers=6, **fields)  # fmt: skip


def test_deepseek_v32_exp_reads_as_mla_with_an_indexer_on_every_layer():
    spec = spec_from_dict(DEEPSEEK_V32_EXP)
    assert spec.family == "deepseek_v32" and spec.mla is not None and spec.indexer is not None
    assert (spec.head_dim, spec.num_kv_heads) == (576, 1)  # the MLA pool row
    assert (spec.indexer.num_heads, spec.indexer.head_dim, spec.indexer.topk) == (64, 128, 2048)
    assert spec.indexer.indexed_layers == tuple(range(61))
    assert not spec.indexer.rope_interleave  # V3.2's indexer rotates half-split pairs
    assert spec.moe is not None and spec.moe.sparse_layers == frozenset(range(3, 61))
    assert spec.quant is not None and spec.num_nextn_layers == 1
    shapes = indexer_shapes(spec)
    assert len(shapes) == 5 * 61
    assert shapes["model.layers.60.self_attn.indexer.wq_b.weight"] == (64 * 128, 1536)
    assert shapes["model.layers.0.self_attn.indexer.weights_proj.weight"] == (64, 7168)


@pytest.mark.parametrize(
    ("fields", "kinds"),
    [
        ({}, "FFFFFF"),  # transformers' default schedule: every layer
        ({"index_topk_freq": 2}, "FFSFSF"),  # offset 2: layer 1, then every 2nd
        ({"index_topk_pattern": "FSSFSS"}, "FSSFSS"),
        ({"indexer_types": ["full", "shared"] * 3}, "FSFSFS"),
    ],
)
def test_glm5_indexer_kinds_follow_transformers(fields, kinds):
    spec = spec_from_dict(glm(**fields))
    assert spec.indexer is not None and spec.indexer.rope_interleave
    letters = {FULL: "F", SHARED: "S"}
    assert "".join(letters[k] for k in spec.indexer.layer_types) == kinds
    assert len(indexer_shapes(spec)) == 5 * kinds.count("F")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"index_topk_pattern": "SFFFFF"}, "first layer must run its own indexer"),
        ({"index_topk_pattern": "FF"}, "one of full|shared per layer"),
        ({"q_lora_rank": None}, "q_lora_rank is missing"),
        ({"index_head_dim": 32}, "at least qk_rope_head_dim"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types has 1 entries for 6 layers"),
    ],
)
def test_bad_indexer_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        spec_from_dict(glm(**fields))


def test_the_indexer_is_replicated_and_only_mla_heads_split():
    """As SGLang and vLLM run it (``ReplicatedLinear``): every indexer tensor whole on every
    rank; MLA's q_b rows split by query head. The logits at TP 2:
    tests/integration/model/test_tensor_parallel.py."""
    spec = spec_from_dict(DEEPSEEK_V32_EXP)
    check_model_shardable(spec, TPGroup(0, 2))
    for name in expected_shapes(spec):
        split = split_of(spec.family, name)
        if ".indexer." in name:
            assert split == REPLICATED, name
    assert split_of(spec.family, "model.layers.3.self_attn.q_b_proj.weight").dim == 0


def test_a_tp_worker_serves_it_to_sglang_and_native_decodes():
    """The model splits, and every rank holds the index keys: a group's leader writes them
    into every SGLang decode rank (tests/interop/test_dsa_landing.py) and every native one
    (tests/integration/daemon/test_dsa_tp.py); over vLLM (whose decodes get no index keys
    from any worker) the daemon's group refuses it at start (exit 78)."""
    from prefill_worker.service.group_startup import check_group_transfer

    spec = spec_from_dict(DEEPSEEK_V32_EXP)
    check_group_transfer(spec, 1, ("native",))
    check_group_transfer(spec, 1, ("vllm",))
    check_group_transfer(spec, 2, ("sglang",))
    check_group_transfer(spec, 2, ("native",))
    with pytest.raises(ValueError, match=r"index keys \(DSA\) to vLLM decodes is not built"):
        check_group_transfer(spec, 2, ("vllm",))
