"""The reference attention backend: torch ``scaled_dot_product_attention``, CPU and CUDA.

A chunk that starts at position 0 attends straight over its fresh q/k/v (no page gather,
plain causal mask). A chunk with earlier positions gathers the keys and values of its prefix
``[0, start)`` from its pages by (page, offset), which reads the per-layer pool views of either
pool layout in place, puts its own fresh ones after them, and uses a bottom-right-aligned
causal mask: query ``i`` (position ``start + i``) sees keys ``j <= start + i``. Its own keys
are the fresh ones, as SGLang's prefill merges ragged (fresh) and paged (prefix) attention:
with an FP8 pool (``model.quant.kv``) only the prefix is read back rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefill_worker.model.attention.base import AttentionBatch, ChunkSpan
from prefill_worker.model.quant.kv import UNSCALED, from_pool


@dataclass(frozen=True, slots=True)
class _Planned:
    q_start: int
    q_end: int
    kv_rows: tuple[torch.Tensor, torch.Tensor] | None  # [start] pages, offsets; None: fresh
    mask: torch.Tensor | None  # [num_tokens, end] bool, True = may attend


class SdpaBackend:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._planned: tuple[_Planned, ...] = ()

    def plan(self, batch: AttentionBatch) -> None:
        self._planned = tuple(self._plan_span(span, batch.page_size) for span in batch.spans)

    def _plan_span(self, span: ChunkSpan, page_size: int) -> _Planned:
        if span.start == 0:
            return _Planned(span.q_start, span.q_end, None, None)
        prefix = torch.arange(span.start)
        pages = torch.tensor(span.page_ids, dtype=torch.int64)[prefix // page_size]  # [start]
        rows = (pages.to(self.device), (prefix % page_size).to(self.device))
        query_pos = torch.arange(span.start, span.end)[:, None]
        mask = torch.arange(span.end)[None, :] <= query_pos  # [n, end]
        return _Planned(span.q_start, span.q_end, rows, mask.to(self.device))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        out: torch.Tensor,
        scales: tuple[float, float] = UNSCALED,
    ) -> None:
        for p in self._planned:
            qs = q[p.q_start : p.q_end]
            ks, vs = k[p.q_start : p.q_end], v[p.q_start : p.q_end]  # [n, KV, D] fresh
            if p.kv_rows is not None:  # the prefix's, from the pages, first: [end, KV, D]
                ks = torch.cat([from_pool(k_pool[p.kv_rows], q.dtype, scales[0]), ks])
                vs = torch.cat([from_pool(v_pool[p.kv_rows], q.dtype, scales[1]), vs])
            out[p.q_start : p.q_end] = _sdpa(qs, ks, vs, p.mask)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``q [n, H, D]``, ``k/v [m, KV, D]`` -> ``[n, H, D]``; GQA by head grouping."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, D]
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    return out[0].transpose(0, 1)
