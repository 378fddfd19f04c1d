"""Attention batches for kernel tests: chunks of requests on scattered pages, so a kernel
that reads the wrong page, or a plan that assumes contiguous pages, shows."""

from __future__ import annotations

import torch

from prefill_worker.model.attention import AttentionBatch, ChunkSpan


def scattered_batch(
    chunks: list[tuple[int, int]], page_size: int, num_pages: int
) -> tuple[AttentionBatch, torch.Tensor]:
    """One span per ``(start, end)`` chunk, each request on every other page counting down
    from the pool's last; with the flat pool rows of every span's new tokens."""
    spans, slots, offset, next_page = [], [], 0, num_pages - 1
    for start, end in chunks:
        count = -(-end // page_size)
        pages = tuple(range(next_page, next_page - 2 * count, -2))
        next_page -= 2 * count
        assert next_page >= -1, "the test's pool is too small for its chunks"
        spans.append(ChunkSpan(offset, offset + end - start, start, end, pages))
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        offset += end - start
    return AttentionBatch(tuple(spans), page_size, offset), torch.tensor(slots)
