"""The HF-config adapter: old and new field spellings, per-family defaults, refusals."""

from __future__ import annotations

import pytest

from prefill_worker.model.hf_config import spec_from_dict

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
}


def test_defaults_and_derived_fields():
    spec = spec_from_dict({**BASE, "eos_token_id": [2, 7], "torch_dtype": "bfloat16"})
    assert (spec.family, spec.num_kv_heads, spec.head_dim) == ("llama", 4, 16)
    assert spec.rope.rope_type == "default" and spec.rope.theta == 10000.0
    assert spec.eos_token_ids == (2, 7) and spec.torch_dtype == "bfloat16"
    assert not (spec.has_qkv_bias or spec.has_qk_norm or spec.tie_word_embeddings)


def test_old_style_rope_fields():
    raw = {
        **BASE,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    }
    rope = spec_from_dict(raw).rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position) == (
        "llama3",
        500000.0,
        8.0,
        8192,
    )


def test_family_specifics():
    qwen2 = spec_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64})
    assert qwen2.has_qkv_bias and not qwen2.has_o_bias
    assert qwen2.max_position == 4096  # use_sliding_window defaults off for Qwen
    qwen3 = spec_from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.has_qk_norm and qwen3.head_dim == 32 and not qwen3.has_qkv_bias
    mistral = spec_from_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 1024}
    )
    assert mistral.max_position == 1024  # longer prompts would need the window


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["BertModel"]}, "BertModel"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"vocab_size": None}, "missing field 'vocab_size'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ],
)
def test_refusals_name_the_field(change, message):
    with pytest.raises((KeyError, ValueError), match=message):
        spec_from_dict({**BASE, **change})
