"""The KV pool tensors (docs/protocol.md, part 2) and their addresses for the transfer engine.

One allocation holds every layer's K and V, in the pool layout ``layout.kind`` names
(``kv.layout`` draws both)::

    layer_major  storage [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
                 k[l] = storage[l, 0], v[l] = storage[l, 1]        contiguous
    page_major   storage [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
                 k[l] = storage[:, l, 0], v[l] = storage[:, l, 1]  strided views
    vllm_blocks  storage [num_layers, num_pages, num_kv_heads, page_size, 2 * head_dim]
                 k[l] = storage[l, ..., :D], v[l] = storage[l, ..., D:], each permuted to
                 [num_pages, page_size, KV, D]                       strided views
    mla          storage [num_layers, num_pages, page_size, 1, kv_lora_rank + rope_dim]
                 k[l] = storage[l] (the layer's latent plane), v = ()

An MLA row is SGLang's (``MLATokenToKVPool``): the normalised latent, then the roped key
part (``write_latent``). Every ``k[l]``/``v[l]`` is a ``[num_pages, page_size, KV, D]`` view
of the storage (never a copy): page p of layer l at ``k_base_addrs[l] + p *
page_stride_bytes``, one page itself contiguous (``vllm_blocks``: one page of one layer, K‖V
of every head, is; vLLM's ``LBHNC`` blocks, so a vLLM decode's block is one run of the pool).
Writers and attention index them by (page, offset), which works for any strides.

A sliding-window model's pool may keep its sliding layers in their own page space
(``cache.sliding_pool: windowed``, docs/models.md "The sliding-window pool"): then the storage
above holds the full layers only, and a second one the sliding layers, with its own page
count (``SlidingSpace``); ``k[l]``/``v[l]`` of a sliding layer is a view of that one, indexed
by the request's sliding pages (``kv.sliding``)::

    windowed     storage  [L_full, 2, num_pages, page_size, KV, D]        layer_major only
                 sliding  [L_sliding, 2, sliding_pages, page_size, KV, D]

Under tensor parallelism each rank owns its own pool, and ``num_kv_heads`` (KV above) is the
rank's local count: the heads ``model.parallel.kv_head_range`` gives it, in order.

A K/V pool may also carry a ``KVMirror`` (``model/kv_mirror.py``): a second paged store, in
memory someone else owns, that a forward fills with the fresh K/V of the tokens the runner
names (``mirroring``), each layer copied from the pool on the mirror's thread while the next
layer computes, so a transfer that needs the KV in another layout finds it written by the
forward itself instead of copying it afterwards (docs/vllm.md, "Layout").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, VLLM_BLOCKS, KVLayout, KVRegions
from prefill_worker.model.kv_mirror import KVMirror, MirrorTargets, MirrorWrites, PoolRuns
from prefill_worker.model.quant.kv import FP8_E4M3, to_pool

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
KV_TORCH_DTYPES = TORCH_DTYPES | {FP8_E4M3: torch.float8_e4m3fn}  # a pool may be FP8 too


def pool_num_pages(
    layout: KVLayout,
    device: torch.device,
    num_pages: int | None = None,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    extra_page_bytes: int = 0,
    reserved_bytes: int = 0,
) -> int:
    """Pages per layer from the first size given: a count, a byte budget, or (CUDA) a
    fraction of the device memory free right now. ``layout.num_pages`` is ignored.
    ``extra_page_bytes``: what each page also costs beside the pool (a DSA index cache);
    ``reserved_bytes``: what a budget gives another pool first (a windowed sliding pool)."""
    bytes_per_page = layout.planes * layout.num_layers * layout.page_bytes + extra_page_bytes
    if num_pages is not None:
        count = num_pages
    elif memory_bytes is not None:
        count = (memory_bytes - reserved_bytes) // bytes_per_page
    elif memory_fraction is not None:
        if device.type != "cuda":
            raise ValueError("cache.memory_fraction needs a CUDA device; set num_pages instead")
        free_bytes, _ = torch.cuda.mem_get_info(device)
        count = (int(free_bytes * memory_fraction) - reserved_bytes) // bytes_per_page
    else:
        raise ValueError("set one of num_pages, memory_bytes or memory_fraction")
    if count < 1:
        raise ValueError(f"the KV budget holds no page (one page costs {bytes_per_page} bytes)")
    return count


@dataclass(frozen=True, slots=True)
class SlidingSpace:
    """The sliding layers' own page space: which layers, and how many pages it has."""

    layers: tuple[int, ...]
    num_pages: int


class KVCache:
    """Owns the K/V pool of every layer; the runner writes pages, transfer reads them."""

    def __init__(
        self, layout: KVLayout, device: torch.device, sliding: SlidingSpace | None = None
    ) -> None:
        self.layout = layout
        self.device = device
        self.sliding = sliding
        page = (layout.page_size, layout.num_kv_heads, layout.head_dim)
        dtype = KV_TORCH_DTYPES[layout.dtype]
        self._mirror: tuple[KVMirror, PoolRuns] | None = None
        self._mirroring: MirrorWrites | None = None  # set by ``mirroring``, for one forward
        self._sliding_storage: torch.Tensor | None = None
        if sliding is not None:
            self._split(layout, sliding, page, dtype)
            return
        if layout.kind == MLA:
            self._storage = torch.zeros(  # [L, P, page_size, 1, D]
                (layout.num_layers, layout.num_pages, *page), dtype=dtype, device=device
            )
            self.k: tuple[torch.Tensor, ...] = tuple(self._storage)  # each [P, ps, 1, D]
            self.v: tuple[torch.Tensor, ...] = ()
            return
        if layout.kind == VLLM_BLOCKS:
            blocks = (layout.num_pages, layout.num_kv_heads, layout.page_size, 2 * layout.head_dim)
            self._storage = torch.zeros(  # [L, P, KV, page_size, 2D]: vLLM's LBHNC
                (layout.num_layers, *blocks), dtype=dtype, device=device
            )
            self._set_block_views()
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

    def _split(
        self, layout: KVLayout, sliding: SlidingSpace, page: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        """The full layers in the pool's storage, the sliding ones in their own."""
        if layout.kind != LAYER_MAJOR:
            raise ValueError(f"a windowed sliding pool is layer_major (not {layout.kind})")
        full = [i for i in range(layout.num_layers) if i not in sliding.layers]
        self._storage = torch.zeros(  # [L_full, 2, P, page_size, KV, D]
            (len(full), 2, layout.num_pages, *page), dtype=dtype, device=self.device
        )
        self._sliding_storage = torch.zeros(  # [L_sliding, 2, P_sliding, page_size, KV, D]
            (len(sliding.layers), 2, sliding.num_pages, *page), dtype=dtype, device=self.device
        )
        planes = {layer: self._storage[i] for i, layer in enumerate(full)}  # [2, P, ...]
        planes |= {layer: self._sliding_storage[i] for i, layer in enumerate(sliding.layers)}
        self.k = tuple(planes[layer][0] for layer in range(layout.num_layers))
        self.v = tuple(planes[layer][1] for layer in range(layout.num_layers))

    @property
    def num_bytes(self) -> int:
        """The bytes the pool holds, both page spaces of a windowed sliding pool."""
        held = self._storage.numel() * self._storage.element_size()
        if self._sliding_storage is not None:
            held += self._sliding_storage.numel() * self._sliding_storage.element_size()
        return held

    def share_storage(self, buffer: np.ndarray, num_kv_heads: int, heads: range) -> None:
        """A ``vllm_blocks`` pool moves into ``buffer`` (uint8, ``[L, P, num_kv_heads,
        page_size, 2D]`` of the pool's dtype: a tensor-parallel group's shared pool, every
        rank its own ``heads`` of it), keeping what it holds (once, at start-up, before the
        pool's addresses are handed out). The K/V views then stride over the whole group's
        heads; ``regions`` no longer describes the pool (the group's pool is described by
        the leader, ``transfer.vllm.direct``)."""
        lay = self.layout
        if lay.kind != VLLM_BLOCKS or len(heads) != lay.num_kv_heads:
            raise ValueError(f"a {lay.kind} pool of {lay.num_kv_heads} heads into heads {heads}")
        dtype = KV_TORCH_DTYPES[lay.dtype]
        whole = torch.from_numpy(buffer).view(dtype)
        shape = (lay.num_layers, lay.num_pages, num_kv_heads, lay.page_size, 2 * lay.head_dim)
        mine = whole.view(shape)[:, :, heads.start : heads.stop]
        mine.copy_(self._storage)
        self._storage = mine
        self._set_block_views()

    def _set_block_views(self) -> None:
        d = self.layout.head_dim
        self.k = tuple(s[..., :d].transpose(1, 2) for s in self._storage)  # [P, ps, KV, D]
        self.v = tuple(s[..., d:].transpose(1, 2) for s in self._storage)

    def attach_mirror(self, mirror: KVMirror) -> None:
        """From now on a forward may also write ``mirror`` (once, at start-up)."""
        lay = self.layout
        if self.sliding is not None:
            raise ValueError("a windowed sliding pool has no mirror (cache.sliding_pool full)")
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
        self._mirror = (mirror, PoolRuns(self.k, self.v, lay.page_size, mirror.run))

    @property
    def has_mirror(self) -> bool:
        return self._mirror is not None

    @contextmanager
    def mirroring(self, targets: MirrorTargets | None) -> Iterator[MirrorWrites | None]:
        """Inside, each ``write`` also queues the copy of ``targets``' tokens of that layer
        into the mirror (the runner brackets a forward with it; None: nothing mirrored). On
        leaving, every copy has ended: a failed copy raises here, unless the body itself
        raised (its error wins; the copy's is logged)."""
        if targets is None:
            yield None
            return
        assert self._mirror is not None, "mirror targets without a mirror attached"
        writes = MirrorWrites(*self._mirror, targets)
        self._mirroring = writes
        try:
            yield writes
        except BaseException:
            try:
                writes.finish()  # the copies still read the pool: never leave them running
            except Exception:
                log.exception("a KV mirror copy failed in a forward that failed too")
            raise
        else:
            writes.finish()
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
        """The pool's ``KVRegions``, with the aux rows the daemon allocated. A windowed
        sliding pool's sliding layers are regions of their own page count (``layer_pages``),
        in the sliding storage (docs/models.md, "The sliding-window pool")."""
        layer_pages: tuple[int, ...] = ()
        if self.sliding is not None:
            sliding, n = self.sliding, self.layout.num_pages
            layer_pages = tuple(
                sliding.num_pages if i in sliding.layers else n
                for i in range(self.layout.num_layers)
            )
        return KVRegions(
            layout=self.layout,
            k_base_addrs=self.k_base_addrs,
            v_base_addrs=self.v_base_addrs,
            device=self.device_name,
            aux_base_addr=aux_base_addr,
            num_aux_rows=num_aux_rows,
            layer_pages=layer_pages,
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k/v [T, KV, D]`` at flat rows ``slots [T]`` (``page * page_size + offset``),
        and queue the mirror's copy of them (``mirroring``). Indexed by (page, offset), so the
        strided page-major views need no copy."""
        index = (slots // self.layout.page_size, slots % self.layout.page_size)
        k_scale, v_scale = self.layout.scales_of(layer)  # checkpoint KV scales: FP8 only
        self.k[layer].index_put_(index, to_pool(k, self.k[layer], k_scale))
        self.v[layer].index_put_(index, to_pool(v, self.v[layer], v_scale))
        if self._mirroring is not None:
            self._mirroring.layer_written(layer)

    def write_latent(
        self, layer: int, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """An MLA pool's rows at ``slots [T]``: ``latent [T, kv_lora_rank]`` (normalised),
        then ``k_rope [T, rope_dim]``."""
        index = (slots // self.layout.page_size, slots % self.layout.page_size)
        rank = latent.shape[-1]
        self.k[layer][..., 0, :rank].index_put_(index, to_pool(latent, self.k[layer]))
        self.k[layer][..., 0, rank:].index_put_(index, to_pool(k_rope, self.k[layer]))

    def read_page(self, layer: int, page_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one page, ``[page_size, KV, D]`` each (views)."""
        return self.k[layer][page_id], self.v[layer][page_id]
