"""Attention with a sliding window and per-head sinks (gpt-oss), in torch, CPU and CUDA.

Planned like ``sdpa.SdpaBackend`` (once per batch, the chunks' spans), then called per layer
with the layer's window (None: a full layer) and sink logits. A chunk's queries run in blocks
of at most ``block_queries`` rows (fewer where their fp32 scores would pass ``score_bytes``: a
full layer of a long prompt); a block at positions ``[a, b)`` reads from the pool only
the keys its window can see, positions ``[max(0, a - window + 1), b)`` (a full layer: from
0), so a sliding layer never reads a page that fell out of every query's window. Per head::

    scores = q k^T * scale,  masked: key j seen by query i iff i - window < j <= i
    p = softmax([scores | sink])[:-1]        (the sink's share of the mass is dropped)
    out = p v

computed in fp32 whatever the model's dtype. The chunk's fresh K/V are in the pool already
(the model writes them before it attends), so every key comes from the pool. With a windowed
sliding pool (``kv.sliding``) a sliding layer's pool is the sliding one and its pages are the
span's ``sliding_page_ids``: the keys it reads are all held there (-1 entries lie below them).
"""

from __future__ import annotations

import torch

from prefill_worker.model.attention.base import AttentionBatch, ChunkSpan
from prefill_worker.model.quant.kv import UNSCALED


class SinkWindowBackend:
    """``plan`` as every backend; ``attend_window`` per layer (``attend`` is a full layer
    without sinks)."""

    name = "sinks"
    block_queries = 1024
    score_bytes = 256 << 20  # the [H, queries, keys] fp32 scores of one block, at most

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spans: tuple[ChunkSpan, ...] = ()
        self._pages: tuple[torch.Tensor, ...] = ()  # each span's page ids
        self._sliding_pages: tuple[torch.Tensor, ...] | None = None  # a windowed pool's
        self._page_size = 1

    def plan(self, batch: AttentionBatch) -> None:
        self._spans, self._page_size = batch.spans, batch.page_size
        self._pages = tuple(
            torch.tensor(span.page_ids, dtype=torch.int64, device=self.device)
            for span in batch.spans
        )
        self._sliding_pages = None
        if batch.spans and batch.spans[0].sliding_page_ids:
            self._sliding_pages = tuple(
                torch.tensor(span.sliding_page_ids, dtype=torch.int64, device=self.device)
                for span in batch.spans
            )

    def _block(self, keys: int, heads: int) -> int:
        """Queries per block: ``block_queries``, fewer when their fp32 scores over ``keys``
        keys (a full layer: the whole prefix) would pass ``score_bytes``."""
        return max(1, min(self.block_queries, self.score_bytes // (4 * heads * (keys + 1))))

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
        self.attend_window(q, k_pool, v_pool, out, None, None, q.shape[-1] ** -0.5)

    def attend_window(
        self,
        q: torch.Tensor,  # [T, H, D], RoPE applied
        k_pool: torch.Tensor,  # [P, page_size, KV, D], this batch's keys written
        v_pool: torch.Tensor,
        out: torch.Tensor,  # [T, H, D], written
        window: int | None,  # keys each query sees, itself included; None: all before it
        sinks: torch.Tensor | None,  # [H] sink logits; None: no sink
        scale: float,
    ) -> None:
        by_span = self._pages
        if window is not None and self._sliding_pages is not None:
            by_span = self._sliding_pages  # a sliding layer of a windowed pool
        for span, pages in zip(self._spans, by_span, strict=True):
            step = self._block(span.end if window is None else window, q.shape[1])
            for a in range(span.start, span.end, step):
                b = min(a + step, span.end)
                rows = slice(span.q_start + a - span.start, span.q_start + b - span.start)
                first = 0 if window is None else max(0, a - window + 1)
                keys = torch.arange(first, b, device=self.device)
                at = (pages[keys // self._page_size], keys % self._page_size)
                queries = torch.arange(a, b, device=self.device)
                out[rows] = _attend(
                    q[rows], k_pool[at], v_pool[at], queries, keys, window, sinks, scale
                )


def _attend(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [m, KV, D]
    v: torch.Tensor,
    queries: torch.Tensor,  # [n] positions
    keys: torch.Tensor,  # [m] positions
    window: int | None,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    qh = q.float().transpose(0, 1).reshape(kv_heads, group * q.shape[0], q.shape[2])
    kh, vh = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [KV, m, D]
    scores = torch.bmm(qh, kh.transpose(1, 2)).mul_(scale)  # [KV, group n, m]
    scores = scores.view(heads, q.shape[0], k.shape[0])  # head h = kv head h // group
    seen = keys[None, :] <= queries[:, None]  # [n, m]
    if window is not None:
        seen &= keys[None, :] > queries[:, None] - window
    scores.masked_fill_(~seen, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # [H, n, 1]; finite: a query sees itself
    if sinks is not None:
        sink = sinks.float()[:, None, None]  # [H, 1, 1]
        top = torch.maximum(top, sink)
    probs = scores.sub_(top).exp_()  # in place: no second [H, n, m]
    total = probs.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total.add_((sink - top).exp_())  # the sink's mass, dropped from the output
    probs.div_(total)
    probs = probs.reshape(kv_heads, group * q.shape[0], k.shape[0])
    attended = torch.bmm(probs, vh).view(heads, q.shape[0], v.shape[2])  # [H, n, D]
    return attended.transpose(0, 1).to(q.dtype)
