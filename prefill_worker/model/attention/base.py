"""What an attention backend is: the batch it is planned for, the ``AttentionBackend``
Protocol (K/V pools) and ``MLAAttentionBackend`` (an MLA pool's latent rows). The backends
(``sdpa.py``, ``flashinfer.py``, ``sdpa_mla.py``, ``flashinfer_mla.py``) and the registry in
``__init__.py`` import it; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from prefill_worker.model.quant.kv import UNSCALED

if TYPE_CHECKING:
    from prefill_worker.model.hf_config import MLASpec


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk in the packed batch: rows ``[q_start, q_end)`` are prompt positions
    ``[start, end)``; the K/V of ``[0, end)`` lives in ``page_ids`` once written."""

    q_start: int
    q_end: int
    start: int
    end: int
    page_ids: tuple[int, ...]  # exactly ceil(end / page_size) pages
    # a windowed sliding pool's entries, as many (-1: not held, below every window); ()
    # with a full pool: the sliding layers read ``page_ids``
    sliding_page_ids: tuple[int, ...] = ()


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
        scales: tuple[float, float] = UNSCALED,  # (K, V): a stored value times its scale
    ) -> None:
        """Causal attention of every chunk over its prompt prefix, into ``out``. The pools
        are read in place (index them, never ``view`` or copy them whole); an FP8 pool's
        values are multiplied by the layer's checkpoint ``scales`` (``model.quant.kv``)."""


@runtime_checkable
class MLAAttentionBackend(AttentionBackend, Protocol):
    """An MLA model's attention: ``attend`` is not called (an MLA pool has no K/V planes)."""

    def attend_latent(
        self,
        q: torch.Tensor,  # [T, H, nope + rope], RoPE applied
        rows: torch.Tensor,  # [T, r + rope], this batch's fresh pool rows
        pool: torch.Tensor,  # [P, page_size, 1, r + rope], the layer's plane, rows written
        kv_b: torch.Tensor,  # [H (nope + v), r]
        spec: MLASpec,
        out: torch.Tensor,  # [T, H, v], written
    ) -> None:
        """Causal attention of every chunk over its prompt prefix's latents, into ``out``
        (scaled by ``spec.softmax_scale``); the pool is read in place."""


BackendFactory = Callable[[torch.device], AttentionBackend]
MLABackendFactory = Callable[[torch.device], MLAAttentionBackend]
