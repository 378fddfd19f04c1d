"""A windowed sliding pool staged for vLLM 0.34's KV-cache groups (``cache.sliding_pool:
windowed``; docs/vllm.md, "Sliding-window models"): what a request's repack copies when its
sliding layers keep only their window.

vLLM's decode reads a full group's every block and a sliding group's last ``window_blocks``
(``groups.VllmGroups.block_ids``, vLLM's ``get_exchange_clipped_blocks``); of those, a sliding
layer's attention reads only the last ``window_tokens`` positions (``sliding_window - 1``,
``swa_window.decode_window_tokens``). Once its last chunk ran, a request holds its sliding pages
from the page of position ``n - window_tokens`` on (``kv.sliding``: ``held_start``), never
freed before the request ends, so every repack of an ``n``-token prompt copies::

    full layers     every position sent, from the request's pages (as a full pool)
    sliding layers  [max(held_start, clip_start), n)   from its sliding pages
                    [clip_start, held_start)            zeros (pages no longer held)
                    before clip_start                   nothing (blocks the decode never reads)

``clip_start``: the first position of the sliding group's blocks. The staging region itself is
unchanged (every layer, one block space): the bytes a decode READs are those of a full pool's
worker; the bytes copied shrink to the full layers' and the window's. No KV mirror: the
forward's sliding layers write the sliding pool, so every position is repacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefill_worker.transfer.push.window_route import window_sources
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.vllm.groups import VllmGroups
from prefill_worker.transfer.vllm.staging import PoolViews, StagingPool, repack


@dataclass(frozen=True, slots=True)
class StagedWindow:
    """A windowed pool's sliding layers as a repack for vLLM sees them."""

    sliding: tuple[int, ...]  # the sliding layers (model ids)
    window_tokens: int  # the positions a decode's sliding layer reads
    window_blocks: int  # the blocks of a sliding group's list
    page_size: int
    block_size: int

    def clip_start(self, num_tokens: int) -> int:
        """The first position of the sliding groups' blocks."""
        num_blocks = -(-num_tokens // self.block_size)
        return max(0, num_blocks - self.window_blocks) * self.block_size

    def held_start(self, num_tokens: int) -> int:
        """The first position of the sliding pages held once the last chunk ran."""
        return max(0, num_tokens - self.window_tokens) // self.page_size * self.page_size

    def kept(self, num_tokens: int) -> range:
        """The positions a sliding layer's repack copies."""
        return range(max(self.held_start(num_tokens), self.clip_start(num_tokens)), num_tokens)

    def cleared(self, num_tokens: int) -> range:
        """The positions of the sliding groups' blocks no sliding page holds: zeroed."""
        return range(self.clip_start(num_tokens), self.kept(num_tokens).start)


def staged_window(
    layers: SlidingLayers, groups: VllmGroups, page_size: int, block_size: int
) -> StagedWindow:
    """The staging of a windowed pool's ``layers`` for vLLM's ``groups`` (the sliding groups'
    block count is theirs: one owner of what is sent)."""
    kept = {n for n in groups.window_blocks if n is not None}
    if len(kept) != 1 or not layers.sliding:
        raise ValueError(f"a windowed pool's sliding layers in groups keeping {kept} blocks")
    (window_blocks,) = kept
    return StagedWindow(layers.sliding, layers.window_tokens, window_blocks, page_size, block_size)


def check_window(
    window: StagedWindow,
    sliding_page_ids: Sequence[int],
    num_pages: int,
    first_page: int,
    tokens: range,
    num_tokens: int,
) -> None:
    """``ValueError`` unless the sliding pages of the window positions in ``tokens`` (prompt
    pages ``[first_page, first_page + num_pages)``) were given and are held."""
    kept = _overlap(tokens, window.kept(num_tokens))
    ps = window.page_size
    pages = np.arange(first_page, first_page + num_pages)
    wanted = (pages >= kept.start // ps) & (pages < -(-kept.stop // ps))
    if not kept or not wanted.any():
        return  # no window position in these pages: no sliding page read
    given = np.asarray(sliding_page_ids, dtype=np.int64) if len(sliding_page_ids) else None
    window_sources(given, num_pages, wanted)


def repack_window(
    pool: PoolViews,
    staging: StagingPool,
    window: StagedWindow,
    page_ids: Sequence[int],
    sliding_page_ids: Sequence[int],
    first_page: int,
    block_ids: Sequence[int],
    tokens: range,
    num_tokens: int,
) -> int:
    """``repack`` of prompt positions ``tokens`` of an ``num_tokens`` prompt from a windowed
    pool (the table above); returns the bytes copied."""
    copied = repack(pool, staging, page_ids, first_page, block_ids, tokens, layers=pool.full)
    kept = _overlap(tokens, window.kept(num_tokens))
    if kept:
        args = (pool, staging, sliding_page_ids, first_page, block_ids, kept)
        copied += repack(*args, layers=pool.sliding)
    clear(staging, pool.sliding, block_ids, _overlap(tokens, window.cleared(num_tokens)))
    return copied


def clear(
    staging: StagingPool, layers: tuple[int, ...], block_ids: Sequence[int], tokens: range
) -> None:
    """Zero prompt positions ``tokens`` of ``layers`` in the request's blocks."""
    rows = staging.all_rows()  # [layers, blocks, heads, block_size, 2]
    bs, at = staging.layout.block_size, tokens.start
    while at < tokens.stop:
        end = min(tokens.stop, (at // bs + 1) * bs)
        block = rows[:, block_ids[at // bs]]  # [layers, heads, block_size, 2]
        block[list(layers), :, at % bs : at % bs + end - at] = np.zeros((), rows.dtype)
        at = end


def _overlap(a: range, b: range) -> range:
    start = max(a.start, b.start)
    return range(start, max(start, min(a.stop, b.stop)))
