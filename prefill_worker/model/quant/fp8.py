"""FP8 weights at load: each FP8 tensor's scale is checked against its shape, and this rank's
slice of the weight is dequantized with the scale rows and columns that cover it.

A tensor-parallel cut need not fall on a block boundary. Rank r's rows ``[start, stop)`` of
a block-scaled weight use scale rows ``start // bo .. (stop - 1) // bo``; a block cut in two
lends its one scale to both ranks::

    weight rows   0 ........ 127 | 128 .... 191 ‖ 192 .... 255 | 256 ... 383
    scale rows    0              | 1            ‖ 1            | 2
                                 rank 0 ‖ rank 1 (cut at 192: block 1 shared)

so every split the sharding table makes is served: each element is multiplied by the scale of
the block it sits in, in the full tensor. The whole scale tensor is read (1/16384 of the
weight at 128 × 128) and indexed by the slice's positions.

Memory: the FP8 slice as read (1 byte per parameter), a float32 copy of it and the scales
expanded to its shape (4 + 4 bytes), multiplied in place; transient, one tensor at a time. Then
the model's dtype: resident weights are 2 bytes per parameter in bf16, twice the FP8 checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from prefill_worker.model.hf_config import CheckpointError
from prefill_worker.model.quant.spec import BLOCK, CHANNEL, TENSOR, QuantSpec

FP8_STORED = "F8_E4M3"  # safetensors' name of torch.float8_e4m3fn
OTHER_FP8 = "F8_E5M2"


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float8_e4m3fn


def check_scales(
    quant: QuantSpec | None,
    shapes: Mapping[str, tuple[int, ...]],
    stored_dtype: Callable[[str], str],
    shape_of: Callable[[str], tuple[int, ...]],
    names: Mapping[str, object],
) -> None:
    """Refuse FP8 tensors without a ``quantization_config``, without their scale, or with a
    scale whose shape does not fit theirs (``shapes``: the expected tensors, checked)."""
    for name, shape in shapes.items():
        dtype = stored_dtype(name)
        if dtype == OTHER_FP8:
            raise CheckpointError(f"tensor {name} is {OTHER_FP8}: only {FP8_STORED} is served")
        if dtype != FP8_STORED:
            continue
        if quant is None:
            raise CheckpointError(
                f"tensor {name} is stored as {FP8_STORED} but config.json has no "
                f"quantization_config to say how it is scaled"
            )
        if len(shape) != 2:
            raise CheckpointError(f"tensor {name} is FP8 with shape {list(shape)}: not a matrix")
        scale = quant.scale_name(name)
        if scale not in names:
            raise CheckpointError(f"tensor {name} is FP8 but its scale {scale} is missing")
        _check_scale_shape(quant, scale, shape_of(scale), shape)


def _check_scale_shape(
    quant: QuantSpec, scale: str, found: tuple[int, ...], weight: tuple[int, ...]
) -> None:
    expected = quant.scale_shape(weight)
    fits = found == expected
    if quant.strategy == TENSOR:
        fits = all(size == 1 for size in found)
    if not fits:
        raise CheckpointError(
            f"tensor {scale} has shape {list(found)}, expected {list(expected)} for a "
            f"{quant.strategy}-scaled weight of shape {list(weight)}"
            + (f" in blocks of {list(quant.block)}" if quant.block else "")
        )


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, dim: int | None, cut: slice
) -> torch.Tensor:
    """``weight`` (FP8, this rank's slice: ``cut`` of dimension ``dim`` of the full tensor,
    ``dim`` None for all of it) times the scale of each element's block, channel or tensor,
    in float32."""
    values = weight.to(torch.float32)  # [rows, columns] of this rank
    factors = scale.to(torch.float32)
    if quant.strategy == TENSOR:
        return values.mul_(factors.reshape(()))
    rows = _positions(values.shape[0], cut if dim == 0 else None)
    if quant.strategy == CHANNEL:
        return values.mul_(factors[rows])  # [rows, 1]
    assert quant.strategy == BLOCK and quant.block is not None
    columns = _positions(values.shape[1], cut if dim == 1 else None)
    block_rows, block_columns = quant.block
    return values.mul_(factors[rows // block_rows][:, columns // block_columns])  # [rows, cols]


def _positions(length: int, cut: slice | None) -> torch.Tensor:
    """Where this rank's ``length`` rows (or columns) sit in the full tensor."""
    start = 0 if cut is None or cut.start is None else cut.start
    return torch.arange(start, start + length)
