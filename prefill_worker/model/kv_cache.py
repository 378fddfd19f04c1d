"""The KV pool tensors (DESIGN §5) and their addresses for the transfer engine.

One allocation holds every layer's K and V::

    storage [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
    k[l] = storage[l, 0]   ─▶ page p of layer l at k_base_addrs[l] + p * page_bytes
    v[l] = storage[l, 1]

Each ``k[l]``/``v[l]`` is contiguous, so a page is one run of ``page_bytes`` bytes.
"""

from __future__ import annotations

import torch

from prefill_worker.kv.layout import KVLayout, KVRegions

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
    bytes_per_page = 2 * layout.num_layers * layout.page_bytes  # K and V of every layer
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
        shape = (layout.num_layers, 2, layout.num_pages, layout.page_size)
        self._storage = torch.zeros(  # [L, 2, P, page_size, KV, D]
            (*shape, layout.num_kv_heads, layout.head_dim),
            dtype=TORCH_DTYPES[layout.dtype],
            device=device,
        )
        self.k: tuple[torch.Tensor, ...] = tuple(self._storage[:, 0])  # each [P, ps, KV, D]
        self.v: tuple[torch.Tensor, ...] = tuple(self._storage[:, 1])

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
        """Store ``k/v [T, KV, D]`` at flat rows ``slots [T]`` (``page * page_size + offset``)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def read_page(self, layer: int, page_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one page, ``[page_size, KV, D]`` each (views)."""
        return self.k[layer][page_id], self.v[layer][page_id]
