"""Mixture-of-experts compute behind a lazy registry, as attention's: ``torch`` (tokens
grouped by expert), ``naive`` (every expert over every token: the benchmark's baseline) and
``auto`` (``torch``). A backend computes ``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` from
the stacked expert weights; routing (``routing.py``) and the shared experts and the TP
all-reduce (``block.py``) are the same for every backend.

No CUDA kernel is registered yet: flashinfer's fused MoE (``cutlass_fused_moe``) is where one
goes, as a factory here, resolved by ``auto`` on CUDA when importable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class ExpertsBackend(Protocol):
    name: str

    def experts(
        self,
        x: torch.Tensor,  # [T, hidden]
        weights: torch.Tensor,  # [T, k], x's dtype
        ids: torch.Tensor,  # [T, k] int64
        gate_up: torch.Tensor,  # [E, 2I, hidden], gate rows first
        down: torch.Tensor,  # [E, hidden, I]
    ) -> torch.Tensor: ...


def _torch(device: torch.device) -> ExpertsBackend:
    from prefill_worker.model.moe.grouped import TorchGroupedExperts

    return TorchGroupedExperts(device)


def _naive(device: torch.device) -> ExpertsBackend:
    from prefill_worker.model.moe.naive import NaiveExperts

    return NaiveExperts(device)


MOE_BACKENDS: dict[str, Callable[[torch.device], ExpertsBackend]] = {
    "torch": _torch,
    "naive": _naive,
}


def resolve_moe_backend_name(name: str, device: torch.device) -> str:
    """``auto`` -> ``torch`` (the only grouped implementation registered); checks the name."""
    if name == "auto":
        return "torch"
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r} (known: auto, {', '.join(MOE_BACKENDS)})")
    return name


def create_moe_backend(name: str, device: torch.device) -> ExpertsBackend:
    return MOE_BACKENDS[resolve_moe_backend_name(name, device)](device)
