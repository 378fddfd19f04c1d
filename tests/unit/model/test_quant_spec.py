"""``quantization_config`` as the shipped FP8 checkpoints write it, read into ``QuantSpec``;
the formats the worker does not serve are refused naming the field. Torch-free."""

from __future__ import annotations

import pytest

from prefill_worker.model.hf_config import spec_from_dict
from prefill_worker.model.quant.spec import BLOCK, CHANNEL, TENSOR, QuantSpec, quant_spec

# DeepSeek-V3's config.json, as shipped (Qwen3-8B-FP8's differs only in the architecture).
DEEPSEEK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]}  # fmt: skip


def compressed(strategy: str, dynamic: bool = True, **weights: object) -> dict:
    group = {
        "weights": {"num_bits": 8, "type": "float", "strategy": strategy, **weights},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": dynamic},
        "targets": ["Linear"],
    }
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}}  # fmt: skip


def test_deepseek_block_fp8():
    spec = quant_spec({"quantization_config": DEEPSEEK})
    assert spec == QuantSpec("fp8", BLOCK, "weight_scale_inv", (128, 128))
    assert spec.scale_name("model.layers.3.mlp.experts.7.up_proj.weight") == (
        "model.layers.3.mlp.experts.7.up_proj.weight_scale_inv"
    )
    assert spec.scale_shape((7168, 18432)) == (56, 144)
    assert spec.scale_shape((576, 7168)) == (5, 56)  # kv_a: a partial last block row


def test_compressed_tensors_strategies():
    channel = quant_spec({"quantization_config": compressed("channel")})
    assert channel == QuantSpec("compressed-tensors", CHANNEL, "weight_scale")
    assert channel.scale_shape((4096, 1024)) == (4096, 1)
    assert quant_spec({"quantization_config": compressed("tensor")}).strategy == TENSOR  # type: ignore[union-attr]
    block = quant_spec({"quantization_config": compressed("block", block_structure=[64, 32])})
    assert block is not None and block.block == (64, 32)
    assert block.scale_name("x.weight") == "x.weight_scale"


def test_no_quantization_config_is_none():
    assert quant_spec({}) is None
    assert quant_spec({"quantization_config": None}) is None


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({**DEEPSEEK, "weight_block_size": None}, "per-tensor fp8"),
        ({**DEEPSEEK, "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({**DEEPSEEK, "activation_scheme": "static"}, "activation scheme 'static'"),
        ({**DEEPSEEK, "weight_block_size": [128]}, r"block size \[128\]"),
        (compressed("channel", dynamic=False), "activation scheme 'static'"),
        (compressed("group"), "strategy 'group'"),
        (compressed("channel", num_bits=4), "4 bits"),
        ({**compressed("channel"), "format": "pack-quantized"}, "'pack-quantized'"),
        ("fp8", "not an object"),
    ],
)
def test_unserved_formats_are_refused_naming_the_field(config, reason):
    with pytest.raises(ValueError, match=reason):
        quant_spec({"quantization_config": config})


def test_the_model_spec_carries_it():
    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "quantization_config": DEEPSEEK}  # fmt: skip
    assert spec_from_dict(raw).quant == QuantSpec("fp8", BLOCK, "weight_scale_inv", (128, 128))
    assert spec_from_dict({**raw, "quantization_config": {}}).quant is None
