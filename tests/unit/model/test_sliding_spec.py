"""The sliding-window families' configs as they ship: gpt-oss-20b's and Gemma-3-1b's
``config.json`` fields (the published values: flat ``rope_theta`` / ``rope_scaling``, MXFP4
``quantization_config``; Gemma's ``sliding_window_pattern`` and ``rope_local_base_freq``,
no ``layer_types``) read into the spec, and the tensor names and shapes the shipped
safetensors hold."""

from __future__ import annotations

from prefill_worker.model.gpt_oss_loader import gpt_oss_shapes
from prefill_worker.model.hf_config import spec_from_dict
from prefill_worker.model.hf_sliding import FULL_ATTENTION, SLIDING_ATTENTION

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}  # fmt: skip
GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
}  # fmt: skip


def test_gpt_oss_20b_as_shipped():
    spec = spec_from_dict(GPT_OSS_20B)
    sliding = spec.sliding
    assert sliding is not None and (spec.family, spec.max_position) == ("gpt_oss", 131072)
    assert sliding.sliding_layers == tuple(range(0, 24, 2))
    assert (sliding.window, sliding.num_experts, sliding.top_k, sliding.mxfp4) == (128, 32, 4, True)
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.factor) == ("yarn", 150000.0, 32.0)
    assert (spec.rope.original_max_position, spec.rope.truncate) == (4096, False)
    assert spec.has_qkv_bias and spec.has_o_bias and spec.moe is None
    shapes = gpt_oss_shapes(spec)
    e = "model.layers.0.mlp.experts."
    assert shapes[e + "gate_up_proj_blocks"] == (32, 5760, 90, 16)
    assert shapes[e + "gate_up_proj_scales"] == (32, 5760, 90)
    assert shapes[e + "down_proj_blocks"] == (32, 2880, 90, 16)
    assert shapes[e + "gate_up_proj_bias"] == (32, 5760)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    assert e + "gate_up_proj" not in shapes


def test_an_unquantized_gpt_oss_reads_dense_expert_tensors():
    raw = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
    shapes = gpt_oss_shapes(spec_from_dict(raw))
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (32, 2880, 2880)


def test_gemma_3_1b_as_shipped():
    spec = spec_from_dict(GEMMA_3_1B)
    sliding = spec.sliding
    assert sliding is not None and spec.family == "gemma3"
    kinds = sliding.layer_kinds
    assert [i for i, k in enumerate(kinds) if k == FULL_ATTENTION] == [5, 11, 17, 23]
    assert kinds.count(SLIDING_ATTENTION) == 22 and sliding.window == 512
    assert (sliding.local_rope_theta, spec.rope.theta, spec.rope.rope_type) == (
        10000.0, 1000000.0, "default"
    )  # fmt: skip
    assert sliding.query_scale == 256**-0.5 and not sliding.has_sinks
    assert spec.has_qk_norm and not spec.has_qkv_bias and spec.max_position == 32768
