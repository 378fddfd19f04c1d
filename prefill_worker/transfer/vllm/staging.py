"""The staging region vLLM decodes READ: blocks in vLLM's ``LBHNC`` layout, and the repack
that fills them from this worker's pool where the forward did not.

vLLM 0.33 reads, per layer, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``: K and V
side by side per (head, token), one contiguous run per block per layer. This worker's pools
keep K and V apart (``kv.layout``), so each request's KV goes into blocks of a staging region
registered once with NIXL: written by the forward itself, as a mirror of the pool
(``layer_view`` is what the runner's ``KVMirror`` is built over; ``block_slots`` the rows a
chunk's tokens go to), or, for tokens no forward of this request wrote after its blocks were
taken (prefix-cache hits, chunks computed before the claim), copied from the pool by
``repack`` (docs/vllm.md, "Layout": the mirror, the repack and what each costs)::

    our page p, slot s  (token t = page index * page_size + s)
      K[l][p, s, h, :]  ─▶  staging[l][block_ids[t // block_size], h, t % block_size, :D]
      V[l][p, s, h, :]  ─▶  staging[l][block_ids[t // block_size], h, t % block_size, D:]

``block_size`` is vLLM's (a multiple of 32 on its CPU backend) and independent of our page
size: the copy goes piece by piece, a piece being the tokens of one page in one block. The
staging blocks a request uses are allocated when its prefill starts and freed by the hold
table. Host memory only; numpy views over the pool's addresses (the runner's tensors outlive
the backend).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prefill_worker.kv.layout import MLA, VLLM_BLOCKS, KVLayout, KVRegions

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # bytes are moved, never read as numbers


class StagingRefused(ValueError):
    """This pool cannot be staged for vLLM (the reason names the field)."""


@dataclass(frozen=True, slots=True)
class StagingLayout:
    """The staging region's shape: ``num_layers`` regions of ``num_blocks`` blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    block_size: int
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        """One block of one layer: K‖V of every head and token."""
        return self.num_kv_heads * self.block_size * 2 * self.head_dim * self.itemsize

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def token_bytes(self) -> int:
        """One token's K‖V over every layer: what staging it moves."""
        return self.num_layers * self.num_kv_heads * 2 * self.head_dim * self.itemsize

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def staging_layout(
    regions: KVRegions, block_size: int, num_blocks: int, num_kv_heads: int | None = None
) -> StagingLayout:
    """The staging shape for this pool (``StagingRefused`` when it cannot be staged);
    ``num_kv_heads``: the model's, where the pool holds a tensor-parallel rank's share."""
    lay = regions.layout
    if lay.kind == MLA:
        raise StagingRefused("kv layout mla: vLLM pulls are served for K/V pools only")
    if regions.device != "cpu":
        raise StagingRefused(f"device {regions.device}: the vLLM repack runs on host pools only")
    if block_size < 1 or num_blocks < 1:
        raise StagingRefused(f"block_size ({block_size}) and num_blocks ({num_blocks}) >= 1")
    heads = lay.num_kv_heads if num_kv_heads is None else num_kv_heads
    return StagingLayout(lay.num_layers, heads, lay.head_dim, lay.itemsize, block_size, num_blocks)


class BlockStore(Protocol):
    """Where the blocks vLLM decodes read (and push WRITEs come from) live: a ``StagingPool``,
    or the pool itself when it is in vLLM's layout (``direct.PoolBlocks``)."""

    layout: StagingLayout
    region_base_addrs: tuple[int, ...]  # one per layer

    @property
    def num_free(self) -> int: ...

    def free(self, block_ids: Sequence[int]) -> None: ...


class StagingPool:
    """The region (one numpy buffer, a region per layer) and its free blocks.

    A request gets the lowest free block ids, in ascending order: a run of ids is a run of
    memory in every layer's region, and NIXL merges READ descriptors that are adjacent, in
    order, on both sides, so where the decode's blocks are consecutive too, vLLM's one
    descriptor per block per layer becomes one per run (docs/vllm.md, "The READ")."""

    def __init__(self, layout: StagingLayout, buffer: np.ndarray | None = None) -> None:
        """``buffer``: uint8 memory of the region's size to use (a tensor-parallel group's
        shared region, ``shared.py``); None: the pool's own."""
        self.layout = layout
        size = layout.num_layers * layout.region_bytes
        if buffer is None:
            buffer = np.zeros(size, dtype=np.uint8)
        assert buffer.dtype == np.uint8 and buffer.size == size, (buffer.dtype, buffer.size, size)
        self._buffer = buffer
        base = self._buffer.ctypes.data
        self.region_base_addrs = tuple(
            base + i * layout.region_bytes for i in range(layout.num_layers)
        )
        self._free = list(range(layout.num_blocks))  # a heap: lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def try_allocate(self, num_blocks: int) -> tuple[int, ...] | None:
        """The ``num_blocks`` lowest free blocks, ascending, or None if fewer are free."""
        if num_blocks > len(self._free):
            return None
        return tuple(heapq.heappop(self._free) for _ in range(num_blocks))

    def free(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)
        assert len(self._free) <= self.layout.num_blocks, "a staging block freed twice"

    def layer_view(self, layer: int) -> np.ndarray:
        """Layer ``layer`` as vLLM reads it: [num_blocks, heads, block_size, 2 * head_dim]."""
        lay = self.layout
        start = layer * lay.region_bytes
        raw = self._buffer[start : start + lay.region_bytes]
        shape = (lay.num_blocks, lay.num_kv_heads, lay.block_size, 2 * lay.head_dim)
        return raw.view(_UINT[lay.itemsize]).reshape(shape)

    def all_rows(self) -> np.ndarray:
        """The region as [layers, num_blocks, heads, block_size, 2] rows of one head's K (0)
        or V (1): each row one ``head_dim`` run, copied as a unit."""
        lay = self.layout
        shape = (lay.num_layers, lay.num_blocks, lay.num_kv_heads, lay.block_size, 2)
        return self._buffer.view(_row_type(lay.head_dim * lay.itemsize)).reshape(shape)


class PoolViews:
    """This worker's pool as numpy views of ``head_dim`` runs (one run, one element: copies move
    whole runs, not items). When every layer's K sits at one stride from the previous layer's
    and its V at one distance from its K (both pool layouts as the runner allocates them),
    ``kv`` is one view ``[2, num_layers, num_pages, page_size, heads]`` and a piece of a page
    moves for every layer and both planes in one copy; otherwise ``kv`` is None and the copy
    goes layer by layer over ``k``/``v`` (``[num_pages, page_size, heads]`` each).

    A windowed sliding pool (``KVRegions.layer_pages``; ``sliding``: its sliding layers) is
    two page spaces: ``runs`` then holds a view of each (``full`` and ``sliding``, by their
    layers; None where uneven), which a repack of those layers copies from (``repack``'s
    ``layers``), each layer's ``k``/``v`` of its own page count."""

    def __init__(self, regions: KVRegions, sliding: Sequence[int] = ()) -> None:
        lay = regions.layout
        self.page_size = lay.page_size
        pages = regions.layer_pages or (lay.num_pages,) * lay.num_layers
        k, v = regions.k_base_addrs, regions.v_base_addrs
        self.k = [self._view(regions, a, n) for a, n in zip(k, pages, strict=True)]
        self.v = [self._view(regions, a, n) for a, n in zip(v, pages, strict=True)]
        self.sliding = tuple(sliding)
        self.full = tuple(i for i in range(lay.num_layers) if i not in self.sliding)
        self.runs: dict[tuple[int, ...], np.ndarray | None] = {}
        if self.sliding:
            self.kv = None
            for layers in (self.full, self.sliding):
                if layers:
                    self.runs[layers] = _uniform_view(regions, layers, pages[layers[0]])
        else:
            self.kv = _uniform_view(regions, range(lay.num_layers), lay.num_pages)

    @staticmethod
    def _view(regions: KVRegions, base_addr: int, num_pages: int) -> np.ndarray:
        lay = regions.layout
        span = _plane_span(lay, num_pages)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(base_addr))
        row_bytes = lay.head_dim * lay.itemsize
        shape = (num_pages, lay.page_size, lay.num_kv_heads)
        strides = (lay.page_stride_bytes, lay.token_stride_bytes, lay.head_stride_bytes)
        rows = raw.view(_row_type(row_bytes))
        return np.lib.stride_tricks.as_strided(rows, shape, strides, writeable=False)


def _uniform_view(regions: KVRegions, layers: Sequence[int], num_pages: int) -> np.ndarray | None:
    """``[2, len(layers), num_pages, page_size, heads]`` over ``layers`` of the pool, or None
    when their addresses are not evenly spaced (or one layer only: nothing to gain)."""
    lay = regions.layout
    k = [regions.k_base_addrs[i] for i in layers]
    v = [regions.v_base_addrs[i] for i in layers]
    if len(k) < 2:
        return None
    layer_stride, kv_stride = k[1] - k[0], v[0] - k[0]
    if any(k[i] != k[0] + i * layer_stride or v[i] != k[i] + kv_stride for i in range(len(k))):
        return None
    low = min(k + v)
    span = max(k + v) - low + _plane_span(lay, num_pages)
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(low))
    row_bytes = lay.head_dim * lay.itemsize
    shape = (2, len(k), num_pages, lay.page_size, lay.num_kv_heads)
    strides = (kv_stride, layer_stride, lay.page_stride_bytes, lay.token_stride_bytes)
    view = np.ndarray(
        shape, _row_type(row_bytes), raw, k[0] - low, (*strides, lay.head_stride_bytes)
    )
    view.flags.writeable = False
    return view


def _plane_span(lay: KVLayout, num_pages: int) -> int:
    """A per-layer K (or V) view of ``num_pages`` pages, first byte to past its last (a
    windowed pool's sliding layers have their own page count; ``vllm_blocks`` never does)."""
    if lay.kind == VLLM_BLOCKS:
        return lay.plane_span_bytes
    return (num_pages - 1) * lay.page_stride_bytes + lay.page_bytes


def _row_type(num_bytes: int) -> np.dtype[np.void]:
    """One ``head_dim`` run as a single numpy element: copies move whole runs, not items."""
    return np.dtype(f"V{num_bytes}")


def block_slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The staging rows (``block * block_size + offset``) of prompt positions [start, end),
    given the request's blocks: where a mirrored forward writes them."""
    positions = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    slots: list[int] = (blocks * block_size + positions % block_size).tolist()
    return slots


def repack(
    pool: PoolViews,
    staging: StagingPool,
    page_ids: Sequence[int],
    first_page: int,
    block_ids: Sequence[int],
    tokens: range,
    heads: range | None = None,
    layers: tuple[int, ...] | None = None,
) -> int:
    """Copy prompt positions ``tokens`` (within prompt pages [first_page, first_page +
    len(page_ids)), held in our pages ``page_ids``) into the request's staging ``block_ids``;
    returns the bytes copied (of every head: at TP > 1 the group's). ``heads``: the staged
    heads the pool holds (a tensor-parallel rank's); None: all. ``layers``: a windowed pool's
    full or sliding layers only (a key of ``PoolViews.runs``, ``page_ids`` then their pages);
    None: every layer.

    One pass, no gather: the tokens are cut where a page or a block ends, and each piece (at
    most ``min(page_size, block_size)`` tokens of one page and one block) is one strided copy
    for every layer and both planes (or one per layer and plane, ``PoolViews``)."""
    ps, bs = pool.page_size, staging.layout.block_size
    start, stop = tokens.start, tokens.stop
    assert first_page * ps <= start and stop <= (first_page + len(page_ids)) * ps, tokens
    if stop <= start:
        return 0
    dst = staging.all_rows()  # [layers, blocks, heads, block_size, 2]
    if heads is not None:
        dst = dst[:, :, heads.start : heads.stop]
    for t0, t1 in _pieces(start, stop, ps, bs):
        page, block = page_ids[t0 // ps - first_page], block_ids[t0 // bs]
        src_slots, dst_slots = slice(t0 % ps, t0 % ps + t1 - t0), slice(t0 % bs, t0 % bs + t1 - t0)
        _copy_piece(pool, dst[:, block, :, dst_slots], page, src_slots, layers)
    lay = staging.layout
    num_layers = lay.num_layers if layers is None else len(layers)
    return (stop - start) * lay.token_bytes // lay.num_layers * num_layers


def _pieces(start: int, stop: int, page_size: int, block_size: int) -> list[tuple[int, int]]:
    """[start, stop) cut at every page and block boundary."""
    cuts = {start, stop}
    for size in (page_size, block_size):
        cuts.update(range(start - start % size + size, stop, size))
    bounds = sorted(cuts)
    return list(itertools.pairwise(bounds))


def _copy_piece(
    pool: PoolViews, dst: np.ndarray, page: int, slots: slice, layers: tuple[int, ...] | None
) -> None:
    """``dst`` ([layers, heads, n, 2]: K then V of n tokens in one block) from ``slots`` of our
    ``page`` (of ``layers`` only, when given)."""
    if layers is not None:
        run = pool.runs.get(layers)
        if run is not None:  # [2, n_layers, n, H] -> [n_layers, H, n, 2], into those rows
            dst[list(layers)] = run[:, :, page, slots].transpose(1, 3, 2, 0)
            return
    elif pool.kv is not None:  # [2, L, n, H] -> [L, H, n, 2]
        np.copyto(dst, pool.kv[:, :, page, slots].transpose(1, 3, 2, 0))
        return
    for layer in range(len(pool.k)) if layers is None else layers:
        np.copyto(dst[layer, :, :, 0], pool.k[layer][page, slots].T)
        np.copyto(dst[layer, :, :, 1], pool.v[layer][page, slots].T)
