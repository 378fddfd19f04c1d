"""Attention backends behind one lazy registry: ``sdpa``, ``flashinfer``, and ``auto``.

A backend is planned once per batch (``plan``) and then called once per layer (``attend``)
after the layer's fresh K/V were written into the pool. Backends are imported only when
chosen, so flashinfer (CUDA only) is never imported on a CPU host.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk in the packed batch: rows ``[q_start, q_end)`` are prompt positions
    ``[start, end)``; the K/V of ``[0, end)`` lives in ``page_ids`` once written."""

    q_start: int
    q_end: int
    start: int
    end: int
    page_ids: tuple[int, ...]  # exactly ceil(end / page_size) pages


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    spans: tuple[ChunkSpan, ...]
    page_size: int
    num_tokens: int


class AttentionBackend(Protocol):
    def plan(self, batch: AttentionBatch) -> None:
        """Prepare per-batch metadata; called once before the first layer."""

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], this batch's fresh keys
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_pool: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], k written;
        v_pool: torch.Tensor,  # views whose page stride may span every layer (page-major)
        out: torch.Tensor,  # [T, num_heads, head_dim], written
    ) -> None:
        """Causal attention of every chunk over its prompt prefix, into ``out``. The pools
        are read in place (index them, never ``view`` or copy them whole)."""


BackendFactory = Callable[[torch.device], AttentionBackend]


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
