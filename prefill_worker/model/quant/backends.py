"""What an FP8 weight becomes once this rank has read it: a registry of backends, one chosen
at load (``select_fp8_backend``: the device and the checkpoint decide).

``dequantize`` (any device; the CPU's) multiplies the FP8 slice by its scales and hands the
model a weight in the model's dtype (``fp8.dequantize``). ``block_gemm`` (CUDA, Hopper, torch
with the blockwise ``scaled_mm``: ``block_gemm.find_kernel``) keeps each FP8 weight as
shipped, this rank's slice with the scale rows and columns of its blocks, as an
``Fp8BlockWeight`` (1 byte per parameter plus 4 per block) that the model's linear layers
multiply by on the block-scaled GEMM (``quant.linear``); ``placement`` says which weights it
dequantizes anyway (``kv_b_proj``, a DSA indexer's, any not whole 128-blocks) and refuses a
tensor-parallel cut inside a block (``misaligned_cut``). Its ``kernel`` is
``block_fp8_linear`` unless given (a CPU test gives a stand-in).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.quant.block_gemm import Fp8BlockWeight, Kernel, find_kernel
from prefill_worker.model.quant.fp8 import dequantize
from prefill_worker.model.quant.placement import gemm_block, kept_in_fp8, misaligned_cut
from prefill_worker.model.quant.spec import QuantSpec

__all__ = ["FP8_WEIGHT_BACKENDS", "BlockGemm", "DequantizeAtLoad", "create_fp8_backend",
           "misaligned_cut", "select_fp8_backend"]  # fmt: skip
log = logging.getLogger(__name__)


class Fp8WeightBackend(Protocol):
    name: str
    keeps_blocks: bool  # whether it keeps FP8 weights as shipped (needs whole-block cuts)

    def prepare(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec,
        dim: int | None, cut: slice,
    ) -> torch.Tensor | Fp8BlockWeight:  # fmt: skip
        """This rank's ``weight`` (FP8; ``cut`` of dimension ``dim`` of the full tensor) and
        the whole ``scale`` tensor, as the model will hold them (a float32 tensor the loader
        casts to the model's dtype, or an ``Fp8BlockWeight`` it moves to the device)."""
        ...


class DequantizeAtLoad:
    """FP8 × scale, per element, in float32; the loader casts it to the model's dtype."""

    name, keeps_blocks = "dequantize", False

    def prepare(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec,
        dim: int | None, cut: slice,
    ) -> torch.Tensor | Fp8BlockWeight:  # fmt: skip
        return dequantize(weight, scale, quant, dim, cut)


class BlockGemm:
    """FP8 weights kept as shipped for the block-scaled GEMM (``placement``'s rule)."""

    name, keeps_blocks = "block_gemm", True

    def __init__(self, kernel: Kernel | None = None) -> None:
        self.kernel = kernel  # None: block_gemm.block_fp8_linear (CUDA)

    def prepare(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec,
        dim: int | None, cut: slice,
    ) -> torch.Tensor | Fp8BlockWeight:  # fmt: skip
        if not (gemm_block(quant) and kept_in_fp8(name, tuple(weight.shape))):
            return dequantize(weight, scale, quant, dim, cut)
        scale = scale.to(torch.float32)
        if dim is not None:  # the scale rows (columns) of this rank's whole blocks
            assert quant.block is not None
            start, unit = cut.start or 0, quant.block[dim]
            blocks = slice(start // unit, (start + weight.shape[dim]) // unit)
            scale = scale[blocks] if dim == 0 else scale[:, blocks]
        return Fp8BlockWeight(weight.contiguous(), scale.contiguous(), self.kernel)


FP8_WEIGHT_BACKENDS: dict[str, Callable[[], Fp8WeightBackend]] = {
    "dequantize": DequantizeAtLoad,
    "block_gemm": BlockGemm,
}


def create_fp8_backend(name: str = "dequantize") -> Fp8WeightBackend:
    if name not in FP8_WEIGHT_BACKENDS:
        raise ValueError(
            f"FP8 weight backend {name!r} is not registered "
            f"(registered: {', '.join(FP8_WEIGHT_BACKENDS)})"
        )
    return FP8_WEIGHT_BACKENDS[name]()


def select_fp8_backend(
    spec: ModelSpec, device: torch.device, kernel_missing: Callable[[], str | None] = find_kernel
) -> str:
    """``block_gemm`` on CUDA for a block-128 FP8 checkpoint of a family whose linear layers
    run it (not the hybrid or sliding-window ones) where the kernel is there
    (``kernel_missing()`` None), else ``dequantize`` (the reason logged on CUDA)."""
    if spec.quant is None or device.type != "cuda":
        return "dequantize"
    why = None
    if not gemm_block(spec.quant):
        why = f"its FP8 is {spec.quant.strategy}-scaled ({spec.quant.block}), not 128 × 128 blocks"
    elif spec.linear is not None or spec.sliding is not None:
        why = f"{spec.family}'s layers do not run the block GEMM"
    else:
        why = kernel_missing()
    if why is None:
        return "block_gemm"
    log.warning("FP8 weights dequantized at load (2 bytes per parameter in bf16): %s", why)
    return "dequantize"
