"""The KV mirror: a second paged store of a pool's K/V, in a layout a transfer reads, that the
forward fills as it fills the pool (docs/vllm.md, "Layout")::

    paired blocks  per layer [num_blocks, KV, block_size, 2 * D]   K then V per (head, token)
                   k[l] = view[..., 0, :] as [num_blocks, block_size, KV, D]   strided views
                   v[l] = view[..., 1, :] likewise; written as numpy runs of D (host only)

The copies run on the mirror's own thread: once ``KVCache.write`` has stored a layer's K/V in
the pool, ``MirrorWrites.layer_written`` queues that layer's copy, pool pages to mirror
blocks, and the forward goes on to the next layer; ``finish`` waits for the last ones, so
after the forward only the last layer's copy (1/L of the work) is left to wait for. The copy
reads the pool, not the forward's K/V buffers, which the next layer reuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

MirrorIndex = tuple[np.ndarray, np.ndarray, np.ndarray]  # block [M, 1], head [1, KV], offset [M, 1]


def as_runs(t: torch.Tensor, run: np.dtype) -> np.ndarray:
    """``t [..., D]`` (host) as numpy runs of D, one element each: ``[...]`` (a view; the last
    dimension must be contiguous, the others may be strided)."""
    raw = t.view(torch.uint8).numpy()  # [..., D * itemsize], the same strides in bytes
    return raw.view(run)[..., 0]


class KVMirror:
    """K‖V blocks per layer over host arrays ``[num_blocks, KV, block_size, 2 * D]`` (K then V
    per (head, token)) the cache does not own, indexed like the pool: row ``block *
    block_size + offset`` of its ``[num_blocks, block_size, KV, D]`` views ``k[l]``/``v[l]``
    (``KV``: the heads it writes, all or a tensor-parallel rank's).

    Writes are numpy copies of whole ``D`` runs (one element each): a torch ``index_put_``
    into the strided views is an OpenMP loop, whose barriers stall for milliseconds per op on
    a loaded host (0.25-0.9 GB/s against numpy's 2-9 GB/s on the 2-core development VM,
    docs/vllm.md). A forward's writes run on the mirror's one thread (``submit``), numpy
    releasing the GIL while it copies."""

    def __init__(
        self, layers: Sequence[np.ndarray], dtype: torch.dtype, heads: range | None = None
    ) -> None:
        """``layers``' items are ``dtype``'s size (their numpy type is only a carrier).
        ``heads``: the blocks' heads this mirror writes (a tensor-parallel rank's, its pool's
        KV in order); None: all of them."""
        num_blocks, num_heads, block_size, width = layers[0].shape
        assert all(a.shape == layers[0].shape and a.flags.c_contiguous for a in layers)
        heads = range(num_heads) if heads is None else heads
        assert heads.step == 1 and 0 <= heads.start < heads.stop <= num_heads, heads
        own = slice(heads.start, heads.stop)
        self.block_size, self.num_kv_heads, self.head_dim = block_size, len(heads), width // 2
        self.run = np.dtype(f"V{self.head_dim * layers[0].itemsize}")  # one head's K (or V)
        shape = (num_blocks, num_heads, block_size, 2)
        self._runs = tuple(a.view(self.run).reshape(shape)[:, own] for a in layers)
        paired = [
            torch.from_numpy(a).view(dtype).view(num_blocks, num_heads, block_size, 2, width // 2)
            for a in layers
        ]
        self.k = tuple(p[:, own, ..., 0, :].permute(0, 2, 1, 3) for p in paired)  # [N, bs, KV, D]
        self.v = tuple(p[:, own, ..., 1, :].permute(0, 2, 1, 3) for p in paired)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-mirror")

    def index_of(self, slots: np.ndarray) -> MirrorIndex:
        """Where each of ``slots [M]``'s heads goes, as numpy indices that broadcast."""
        flat = slots[:, None]
        heads = np.arange(self.num_kv_heads)[None, :]
        return flat // self.block_size, heads, flat % self.block_size

    def write(self, layer: int, index: MirrorIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k/v [M, KV, D]`` (host) at ``index`` (``index_of`` their slots), on the caller's
        thread."""
        k_runs, v_runs = (as_runs(t.contiguous(), self.run) for t in (k, v))
        self.write_runs(layer, index, k_runs, v_runs)

    def write_runs(self, layer: int, index: MirrorIndex, k: np.ndarray, v: np.ndarray) -> None:
        """``k/v [M, KV]`` runs at ``index``."""
        runs = self._runs[layer]
        blocks, heads, offsets = index
        runs[blocks, heads, offsets, 0] = k
        runs[blocks, heads, offsets, 1] = v

    def submit(self, copy: Callable[[], None]) -> Future[None]:
        """Run ``copy`` on the mirror's thread (one at a time, in order)."""
        return self._thread.submit(copy)


class PoolRuns:
    """A host pool's K and V planes (``[P, page_size, KV, D]`` views, strided or not) as numpy
    runs of D ``[P, page_size, KV]``: what the mirror's thread gathers from."""

    def __init__(
        self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], page_size: int, run: np.dtype
    ) -> None:
        self.page_size = page_size
        self.k = tuple(as_runs(t, run) for t in k)
        self.v = tuple(as_runs(t, run) for t in v)


@dataclass(frozen=True, slots=True, eq=False)
class MirrorTargets:
    """The tokens of a batch whose K/V also go to the mirror: their pool rows and mirror rows."""

    pool_slots: np.ndarray  # [M] int64, page * page_size + offset in the pool
    slots: np.ndarray  # [M] int64, block * block_size + offset in the mirror


class MirrorWrites:
    """One forward's mirror copies: ``layer_written(l)`` once the pool holds layer l, then
    ``finish`` (which raises the first copy's error). ``copy_s`` is the copies' own time on
    the mirror's thread; ``wait_s`` what ``finish`` waited, the forward's share of them."""

    def __init__(self, mirror: KVMirror, pool: PoolRuns, targets: MirrorTargets) -> None:
        self._mirror, self._pool = mirror, pool
        pool_slots = targets.pool_slots
        self._pages, self._offsets = pool_slots // pool.page_size, pool_slots % pool.page_size
        self._index = mirror.index_of(targets.slots)
        self._copies: list[Future[None]] = []
        self.copy_s = 0.0
        self.wait_s = 0.0

    def layer_written(self, layer: int) -> None:
        self._copies.append(self._mirror.submit(lambda: self._copy(layer)))

    def _copy(self, layer: int) -> None:
        start = time.perf_counter()
        k = self._pool.k[layer][self._pages, self._offsets]  # [M, KV] runs
        v = self._pool.v[layer][self._pages, self._offsets]
        self._mirror.write_runs(layer, self._index, k, v)
        self.copy_s += time.perf_counter() - start  # one thread: no race

    def finish(self) -> None:
        """Wait for every queued copy; raise the first one's error, if any."""
        start = time.perf_counter()
        errors = [c.exception() for c in self._copies]
        self.wait_s = time.perf_counter() - start
        for error in errors:
            if error is not None:
                raise error
