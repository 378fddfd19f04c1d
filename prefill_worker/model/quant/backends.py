"""What an FP8 weight becomes once this rank has read it: a registry of backends, chosen once
at load, where a CUDA block-scaled FP8 GEMM plugs in.

``dequantize`` (any device; the only one registered) multiplies the FP8 slice by its scales
and hands the model a weight in the model's dtype (``fp8.dequantize``). The CUDA kernel such a
backend calls is ``block_gemm.block_fp8_linear`` (not registered until the model's linear
layers dispatch on its ``Fp8BlockWeight``). A GEMM backend would
instead keep the FP8 bytes and the scales (1 byte per parameter plus 4 per block) and its
``prepare`` return a weight the model's linear layers dispatch on. Such a kernel works on
whole blocks, so it also needs every rank's cut on a block boundary: ``misaligned_cut`` says
where a split cuts one (DeepSeek-V3 at TP 8 never does: 3072 q_b rows, 2048 o columns, 256
rows of each expert per rank; Qwen3-4B-FP8's MLP of 9728 at TP 8, 1216 rows a rank, does),
which such a backend must refuse with that reason; dequantizing serves every cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from prefill_worker.model.quant.fp8 import dequantize
from prefill_worker.model.quant.spec import BLOCK, QuantSpec


class Fp8WeightBackend(Protocol):
    def prepare(
        self, weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, dim: int | None,
        cut: slice,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's ``weight`` (FP8; ``cut`` of dimension ``dim`` of the full tensor) and
        the whole ``scale`` tensor, as the model will hold them."""
        ...


class DequantizeAtLoad:
    """FP8 × scale, per element, in float32; the loader casts it to the model's dtype."""

    def prepare(
        self, weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec, dim: int | None,
        cut: slice,
    ) -> torch.Tensor:  # fmt: skip
        return dequantize(weight, scale, quant, dim, cut)


FP8_WEIGHT_BACKENDS: dict[str, Callable[[], Fp8WeightBackend]] = {"dequantize": DequantizeAtLoad}


def create_fp8_backend(name: str = "dequantize") -> Fp8WeightBackend:
    if name not in FP8_WEIGHT_BACKENDS:
        raise ValueError(
            f"FP8 weight backend {name!r} is not registered "
            f"(registered: {', '.join(FP8_WEIGHT_BACKENDS)})"
        )
    return FP8_WEIGHT_BACKENDS[name]()


def misaligned_cut(quant: QuantSpec, name: str, dim: int, cut: slice, length: int) -> str | None:
    """Why rank's ``cut`` of dimension ``dim`` (of ``length``) of ``name`` splits a scale
    block, or None when it starts and ends on block boundaries (or the tensor's end)."""
    if quant.strategy != BLOCK or quant.block is None:
        return None
    unit = quant.block[dim]
    start, stop = cut.start or 0, length if cut.stop is None else cut.stop
    if start % unit == 0 and (stop % unit == 0 or stop == length):
        return None
    return (
        f"tensor {name}: this rank's {'rows' if dim == 0 else 'columns'} [{start}, {stop}) cut "
        f"a {unit}-wide scale block; a block-scaled FP8 GEMM needs whole blocks per rank"
    )
