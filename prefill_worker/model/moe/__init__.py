"""Mixture-of-experts compute behind a lazy registry, as attention's: ``grouped`` (tokens
grouped by expert, torch ops; any device), ``flashinfer`` (its fused CUTLASS MoE; CUDA,
bf16/fp16), ``naive`` (every expert over every token: the benchmark's baseline) and ``auto``
(``flashinfer`` on CUDA when importable and the dtype is half precision, else ``grouped``;
``grouped`` when the experts are kept in FP8 for the block-scaled GEMM, which it calls once
per expert: flashinfer's fused MoE takes bf16/fp16 stacks).
The configuration's ``model.moe_backend`` names one; ``resolve_moe_backend_name`` is the one
place that decides what ``auto`` means and whether a choice fits the device.

A backend computes ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` from the stacked expert
weights, which its ``prepare`` may reorder once at start-up; routing (``routing.py``), the
shared experts and the TP all-reduce (``block.py``) are the same for every backend.
Backends are imported only when chosen, so flashinfer is never imported on a CPU host.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from prefill_worker.model.moe.base import ExpertsBackend, MoEWeights

__all__ = [
    "MOE_BACKENDS",
    "ExpertsBackend",
    "MoEWeights",
    "create_moe_backend",
    "resolve_moe_backend_name",
]


def _grouped(device: torch.device) -> ExpertsBackend:
    from prefill_worker.model.moe.grouped import TorchGroupedExperts

    return TorchGroupedExperts(device)


def _flashinfer(device: torch.device) -> ExpertsBackend:
    from prefill_worker.model.moe.flashinfer import FlashInferExperts

    return FlashInferExperts(device)


def _naive(device: torch.device) -> ExpertsBackend:
    from prefill_worker.model.moe.naive import NaiveExperts

    return NaiveExperts(device)


MOE_BACKENDS: dict[str, Callable[[torch.device], ExpertsBackend]] = {
    "grouped": _grouped,
    "flashinfer": _flashinfer,
    "naive": _naive,
}
HALF = (torch.bfloat16, torch.float16)


def has_flashinfer_moe() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_moe_backend_name(
    name: str, device: torch.device, dtype: torch.dtype, fp8_experts: bool = False
) -> str:
    """``auto`` -> ``flashinfer`` on CUDA in bf16/fp16 when importable, else ``grouped``;
    checks an explicit choice against the device and dtype (``ValueError``). ``fp8_experts``:
    the experts stay FP8 (``quant.backends``' ``block_gemm``), which only ``grouped`` and
    ``naive`` run."""
    if name == "flashinfer" and fp8_experts:
        raise ValueError(
            "MoE backend 'flashinfer' takes bf16/fp16 experts, but this FP8 checkpoint's "
            "experts are kept in FP8 for the block-scaled GEMM: use moe_backend auto or grouped"
        )
    if name == "auto":
        usable = device.type == "cuda" and dtype in HALF and has_flashinfer_moe()
        usable = usable and not fp8_experts
        return "flashinfer" if usable else "grouped"
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r} (known: auto, {', '.join(MOE_BACKENDS)})")
    if name == "flashinfer" and (device.type != "cuda" or dtype not in HALF):
        raise ValueError("MoE backend 'flashinfer' needs a CUDA device and bf16/fp16 weights")
    if name == "flashinfer" and not has_flashinfer_moe():
        raise ValueError("MoE backend 'flashinfer' is not installed (pip install .[cuda])")
    return name


def create_moe_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> ExpertsBackend:
    return MOE_BACKENDS[resolve_moe_backend_name(name, device, dtype)](device)
