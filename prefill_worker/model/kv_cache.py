"""The KV pool tensors (docs/protocol.md, part 2) and their addresses for the transfer engine.

One allocation holds every layer's K and V, in the pool layout ``layout.kind`` names
(``kv.layout`` draws both)::

    layer_major  storage [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
                 k[l] = storage[l, 0], v[l] = storage[l, 1]        contiguous
    page_major   storage [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
                 k[l] = storage[:, l, 0], v[l] = storage[:, l, 1]  strided views
    mla          storage [num_layers, num_pages, page_size, 1, kv_lora_rank + rope_dim]
                 k[l] = storage[l] (the layer's latent plane), v = ()

An MLA row is SGLang's (``MLATokenToKVPool``): the normalised latent, then the roped key
part (``write_latent``). Every ``k[l]``/``v[l]`` is a ``[num_pages, page_size, KV, D]`` view
of the storage (never a copy): page p of layer l at ``k_base_addrs[l] + p *
page_stride_bytes``, one page itself contiguous. Writers and attention index them by (page,
offset), which works for any page stride.

Under tensor parallelism each rank owns its own pool, and ``num_kv_heads`` (KV above) is the
rank's local count: the heads ``model.parallel.kv_head_range`` gives it, in order.

A K/V pool may also carry a ``KVMirror``: a second paged store, in memory someone else owns,
that ``write`` fills with the fresh K/V of the tokens the runner names for the forward in
hand (``mirroring``), so a transfer that needs the KV in another layout finds it written by
the forward itself instead of copying it afterwards (docs/vllm.md, "Layout")::

    paired blocks  per layer [num_blocks, KV, block_size, 2 * D]   K then V per (head, token)
                   k[l] = view[..., 0, :] as [num_blocks, block_size, KV, D]   strided views
                   v[l] = view[..., 1, :] likewise; written as numpy runs of D (host only)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, KVLayout, KVRegions

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def pool_num_pages(
    layout: KVLayout,
    device: torch.device,
    num_pages: int | None = None,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """Pages per layer from the first size given: a count, a byte budget, or (CUDA) a
    fraction of the device memory free right now. ``layout.num_pages`` is ignored."""
    bytes_per_page = layout.planes * layout.num_layers * layout.page_bytes  # every plane
    if num_pages is not None:
        count = num_pages
    elif memory_bytes is not None:
        count = memory_bytes // bytes_per_page
    elif memory_fraction is not None:
        if device.type != "cuda":
            raise ValueError("cache.memory_fraction needs a CUDA device; set num_pages instead")
        free_bytes, _ = torch.cuda.mem_get_info(device)
        count = int(free_bytes * memory_fraction) // bytes_per_page
    else:
        raise ValueError("set one of num_pages, memory_bytes or memory_fraction")
    if count < 1:
        raise ValueError(f"the KV budget holds no page (one page costs {bytes_per_page} bytes)")
    return count


MirrorIndex = tuple[np.ndarray, np.ndarray, np.ndarray]  # block [M, 1], head [1, KV], offset [M, 1]


class KVMirror:
    """K‖V blocks per layer over host arrays ``[num_blocks, KV, block_size, 2 * D]`` (K then V
    per (head, token)) the cache does not own, indexed like the pool: row ``block *
    block_size + offset`` of its ``[num_blocks, block_size, KV, D]`` views ``k[l]``/``v[l]``.

    Writes are numpy copies of whole ``D`` runs (one element each), on the caller's thread:
    a torch ``index_put_`` into the strided views is an OpenMP loop, whose barriers stall for
    milliseconds per op on a loaded host (0.25-0.9 GB/s against numpy's 2-9 GB/s on the
    2-core development VM, docs/vllm.md)."""

    def __init__(self, layers: Sequence[np.ndarray], dtype: torch.dtype) -> None:
        """``layers``' items are ``dtype``'s size (their numpy type is only a carrier)."""
        num_blocks, heads, block_size, width = layers[0].shape
        assert all(a.shape == layers[0].shape and a.flags.c_contiguous for a in layers)
        self.block_size, self.num_kv_heads, self.head_dim = block_size, heads, width // 2
        run = np.dtype(f"V{self.head_dim * layers[0].itemsize}")  # one head's K (or V)
        self._runs = tuple(a.view(run).reshape(num_blocks, heads, block_size, 2) for a in layers)
        paired = [
            torch.from_numpy(a).view(dtype).view(num_blocks, heads, block_size, 2, width // 2)
            for a in layers
        ]
        self.k = tuple(p[..., 0, :].permute(0, 2, 1, 3) for p in paired)  # [N, bs, KV, D]
        self.v = tuple(p[..., 1, :].permute(0, 2, 1, 3) for p in paired)

    def index_of(self, slots: np.ndarray) -> MirrorIndex:
        """Where each of ``slots [M]``'s heads goes, as numpy indices that broadcast."""
        flat = slots[:, None]
        heads = np.arange(self.num_kv_heads)[None, :]
        return flat // self.block_size, heads, flat % self.block_size

    def write(self, layer: int, index: MirrorIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k/v [M, KV, D]`` at ``index`` (``index_of`` their slots)."""
        runs = self._runs[layer]
        blocks, heads, offsets = index
        runs[blocks, heads, offsets, 0] = _as_runs(k, runs.dtype)
        runs[blocks, heads, offsets, 1] = _as_runs(v, runs.dtype)


def _as_runs(t: torch.Tensor, run: np.dtype) -> np.ndarray:
    """``t [M, KV, D]`` as ``[M, KV]`` runs of D (no copy when contiguous)."""
    raw = t.contiguous().view(torch.uint8).numpy()  # [M, KV, D * itemsize]
    return raw.view(run)[..., 0]


@dataclass(frozen=True, slots=True, eq=False)
class MirrorTargets:
    """The rows of a packed batch whose K/V also go to the mirror, and their mirror rows."""

    rows: torch.Tensor | None  # [M] int64, rows of the batch; None: every row, in order
    slots: np.ndarray  # [M] int64, block * block_size + offset in the mirror (host memory)


@dataclass(frozen=True, slots=True, eq=False)
class _Mirroring:
    """One forward's targets, as ``KVMirror.write`` takes them (computed once, not per layer)."""

    mirror: KVMirror
    rows: torch.Tensor | None  # of the batch; None: all
    index: MirrorIndex  # KVMirror.index_of the slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.rows is not None:
            k, v = k[self.rows], v[self.rows]  # [M, KV, D]
        self.mirror.write(layer, self.index, k, v)


class KVCache:
    """Owns the K/V pool of every layer; the runner writes pages, transfer reads them."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        page = (layout.page_size, layout.num_kv_heads, layout.head_dim)
        dtype = TORCH_DTYPES[layout.dtype]
        self._mirror: KVMirror | None = None
        self._mirroring: _Mirroring | None = None  # set by ``mirroring``, for one forward
        if layout.kind == MLA:
            self._storage = torch.zeros(  # [L, P, page_size, 1, D]
                (layout.num_layers, layout.num_pages, *page), dtype=dtype, device=device
            )
            self.k: tuple[torch.Tensor, ...] = tuple(self._storage)  # each [P, ps, 1, D]
            self.v: tuple[torch.Tensor, ...] = ()
            return
        if layout.kind == LAYER_MAJOR:
            self._storage = torch.zeros(  # [L, 2, P, page_size, KV, D]
                (layout.num_layers, 2, layout.num_pages, *page), dtype=dtype, device=device
            )
            per_layer = self._storage  # [L, 2, P, page_size, KV, D]
        else:
            self._storage = torch.zeros(  # [P, L, 2, page_size, KV, D]
                (layout.num_pages, layout.num_layers, 2, *page), dtype=dtype, device=device
            )
            per_layer = self._storage.permute(1, 2, 0, 3, 4, 5)  # [L, 2, P, ...], a view
        self.k = tuple(per_layer[:, 0])  # each [P, ps, KV, D]
        self.v = tuple(per_layer[:, 1])

    def attach_mirror(self, mirror: KVMirror) -> None:
        """From now on a forward may also write ``mirror`` (once, at start-up)."""
        lay = self.layout
        if lay.kind == MLA:
            raise ValueError("kv layout mla: an MLA pool has no K and V planes to mirror")
        want = (lay.num_layers, lay.num_kv_heads, lay.head_dim)
        got = (len(mirror.k), mirror.num_kv_heads, mirror.head_dim)
        if got != want:
            raise ValueError(f"a mirror of (layers, KV, D) {got}; the pool has {want}")
        if (mirror.k[0].dtype, mirror.k[0].device) != (self.k[0].dtype, self.k[0].device):
            raise ValueError(
                f"a mirror in {mirror.k[0].dtype} on {mirror.k[0].device}; "
                f"the pool is {self.k[0].dtype} on {self.k[0].device}"
            )
        self._mirror = mirror

    @contextmanager
    def mirroring(self, targets: MirrorTargets | None) -> Iterator[None]:
        """Inside, ``write`` also stores ``targets``' rows in the mirror (the runner brackets
        a forward with it; None: nothing mirrored)."""
        if targets is None:
            yield
            return
        assert self._mirror is not None, "mirror targets without a mirror attached"
        index = self._mirror.index_of(targets.slots)
        self._mirroring = _Mirroring(self._mirror, targets.rows, index)
        try:
            yield
        finally:
            self._mirroring = None

    @property
    def k_base_addrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.k)

    @property
    def v_base_addrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.v)

    @property
    def device_name(self) -> str:
        """``cpu`` or ``cuda:N``, as ``KVRegions.device`` wants it."""
        device = self._storage.device
        return f"cuda:{device.index}" if device.type == "cuda" else "cpu"

    def regions(self, aux_base_addr: int, num_aux_rows: int) -> KVRegions:
        """The pool's ``KVRegions``, with the aux rows the daemon allocated."""
        return KVRegions(
            layout=self.layout,
            k_base_addrs=self.k_base_addrs,
            v_base_addrs=self.v_base_addrs,
            device=self.device_name,
            aux_base_addr=aux_base_addr,
            num_aux_rows=num_aux_rows,
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k/v [T, KV, D]`` at flat rows ``slots [T]`` (``page * page_size + offset``),
        and the mirrored rows in the mirror (``mirroring``). Indexed by (page, offset), so the
        strided page-major views (and the mirror's) need no copy."""
        index = (slots // self.layout.page_size, slots % self.layout.page_size)
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)
        if self._mirroring is not None:
            self._mirroring.write(layer, k, v)

    def write_latent(
        self, layer: int, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """An MLA pool's rows at ``slots [T]``: ``latent [T, kv_lora_rank]`` (normalised),
        then ``k_rope [T, rope_dim]``."""
        index = (slots // self.layout.page_size, slots % self.layout.page_size)
        rank = latent.shape[-1]
        self.k[layer][..., 0, :rank].index_put_(index, latent)
        self.k[layer][..., 0, rank:].index_put_(index, k_rope)

    def read_page(self, layer: int, page_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one page, ``[page_size, KV, D]`` each (views)."""
        return self.k[layer][page_id], self.v[layer][page_id]
