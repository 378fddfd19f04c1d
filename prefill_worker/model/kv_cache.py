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
"""

from __future__ import annotations

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


class KVCache:
    """Owns the K/V pool of every layer; the runner writes pages, transfer reads them."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        page = (layout.page_size, layout.num_kv_heads, layout.head_dim)
        dtype = TORCH_DTYPES[layout.dtype]
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
        """Store ``k/v [T, KV, D]`` at flat rows ``slots [T]`` (``page * page_size + offset``).
        Indexed by (page, offset), so the strided page-major views need no copy."""
        index = (slots // self.layout.page_size, slots % self.layout.page_size)
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

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
