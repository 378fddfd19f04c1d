"""Attention backends behind one lazy registry: ``sdpa``, ``flashinfer``, and ``auto``.

A backend is planned once per batch (``plan``) and then called once per layer (``attend``)
after the layer's fresh K/V were written into the pool. Backends are imported only when
chosen, so flashinfer (CUDA only) is never imported on a CPU host. The batch and the
backend Protocol are in ``base.py`` (re-exported here), which the backends import.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from prefill_worker.model.attention.base import (
    AttentionBackend,
    AttentionBatch,
    BackendFactory,
    ChunkSpan,
)

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionBatch",
    "BackendFactory",
    "ChunkSpan",
    "create_backend",
    "has_flashinfer",
    "resolve_backend_name",
]


def _sdpa(device: torch.device) -> AttentionBackend:
    from prefill_worker.model.attention.sdpa import SdpaBackend

    return SdpaBackend(device)


def _flashinfer(device: torch.device) -> AttentionBackend:
    from prefill_worker.model.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(device)


BACKENDS: dict[str, BackendFactory] = {"sdpa": _sdpa, "flashinfer": _flashinfer}


def has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` -> ``flashinfer`` on CUDA when importable, else ``sdpa``; checks the choice."""
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and has_flashinfer() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: auto, {', '.join(BACKENDS)})")
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("attention backend 'flashinfer' needs a CUDA device")
    if name == "flashinfer" and not has_flashinfer():
        raise ValueError("attention backend 'flashinfer' is not installed (pip install .[cuda])")
    return name


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    return BACKENDS[resolve_backend_name(name, device)](device)
