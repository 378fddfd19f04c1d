"""A checkpoint's ``quantization_config``, read into a typed ``QuantSpec``. Torch-free.

Two shipped formats store the same thing, a float8_e4m3fn weight and a float32 scale that
multiplies it back (``weight = fp8 × scale``, per block, channel or tensor)::

    quant_method      scale tensor               scale shape of a [out, in] weight
    fp8               <name>_scale_inv           [ceil(out / bo), ceil(in / bi)]   block (bo, bi)
    (DeepSeek-V3/R1, Qwen3-FP8, Kimi-K2, GLM-4.5-FP8: weight_block_size [128, 128])
    compressed-tensors <name>_scale              block: as above; channel: [out, 1];
    (format float-quantized)                     tensor: [1] or []

(DeepSeek's name ``scale_inv`` is the inverse of the scale its quantizer divided by, i.e.
the factor that dequantizes.) Which tensors are FP8 is read from the file (their stored dtype),
not from name lists: a norm, the router or ``lm_head`` is kept in its own dtype. Activation
scales are not used: the dequantizing path computes in the model's dtype, so only dynamic (or
absent) activation quantization is accepted; a static ``input_scale`` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BLOCK, CHANNEL, TENSOR = "block", "channel", "tensor"


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # the config's quant_method: "fp8" | "compressed-tensors"
    strategy: str  # BLOCK | CHANNEL | TENSOR: what one scale covers
    scale_suffix: str  # "weight_scale_inv" (fp8) | "weight_scale" (compressed-tensors)
    block: tuple[int, int] | None = None  # (rows, columns) of one block; BLOCK only

    def scale_name(self, weight_name: str) -> str:
        """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv`` (or ``_scale``)."""
        return weight_name.removesuffix("weight") + self.scale_suffix

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor a weight of ``shape`` ships with (TENSOR: one value, any rank)."""
        if self.strategy == CHANNEL:
            return (shape[0], 1)
        if self.strategy == TENSOR:
            return (1,)
        assert self.block is not None
        return tuple(-(-size // unit) for size, unit in zip(shape, self.block, strict=True))


def quant_spec(raw: Mapping[str, Any]) -> QuantSpec | None:
    """The checkpoint's quantization, None when it has none; ``ValueError`` naming the field
    for a format the worker does not serve."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"quantization_config {quant!r} is not an object")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise ValueError(
        f"quantized checkpoints ({method!r}) are not supported (supported: 'fp8' with "
        f"weight_block_size, 'compressed-tensors' FP8)"
    )


def _fp8(quant: Mapping[str, Any]) -> QuantSpec:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 fmt {fmt!r} is not supported (only e4m3)")
    _check_dynamic(quant.get("activation_scheme", "dynamic"))
    block = quant.get("weight_block_size")
    if not block:
        raise ValueError("fp8 without weight_block_size (per-tensor fp8) is not supported")
    return QuantSpec("fp8", BLOCK, "weight_scale_inv", _block(block))


def _compressed_tensors(quant: Mapping[str, Any]) -> QuantSpec:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (float-quantized)")
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups (expected 1)")
    weights = groups[0].get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ValueError(
            f"compressed-tensors weights of {weights.get('num_bits')} bits "
            f"{weights.get('type')!r} are not supported (only 8-bit float)"
        )
    activations = groups[0].get("input_activations")
    if activations:
        _check_dynamic("dynamic" if activations.get("dynamic") else "static")
    strategy = weights.get("strategy")
    if strategy == BLOCK:
        return QuantSpec(quant["quant_method"], BLOCK, "weight_scale",
                         _block(weights.get("block_structure")))  # fmt: skip
    if strategy not in (CHANNEL, TENSOR):
        raise ValueError(f"compressed-tensors strategy {strategy!r} is not supported")
    return QuantSpec(quant["quant_method"], strategy, "weight_scale")


def _check_dynamic(scheme: str) -> None:
    if scheme != "dynamic":
        raise ValueError(
            f"activation scheme {scheme!r} is not supported (only dynamic: the weights are "
            f"dequantized and static activation scales would be ignored)"
        )


def _block(value: Any) -> tuple[int, int]:
    if not isinstance(value, list | tuple) or len(value) != 2 or min(value) < 1:
        raise ValueError(f"weight block size {value!r} is not two positive integers")
    return int(value[0]), int(value[1])
