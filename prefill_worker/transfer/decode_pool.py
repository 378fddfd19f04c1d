"""A decode pool given as torch tensors, described as regions (``KVReceiver.from_tensors``).

Checks that every K and V tensor matches the first and is contiguous, derives the layout from
their shape, allocates the aux rows in host memory, and names the pool's device as
``KVRegions.device`` does. Never imports torch: it reads the tensors it is handed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.layout import KVLayout, KVRegions


def regions_from_tensors(
    k_caches: Sequence[Any], v_caches: Sequence[Any], num_aux_rows: int
) -> tuple[KVRegions, list[Any]]:
    """The regions of per-layer tensors [num_pages, page_size, num_kv_heads, head_dim], all
    on one device and contiguous; and the buffers the receiver must keep alive (aux first)."""
    k0 = k_caches[0]
    device = _pool_device(k0.device)
    for t in (*k_caches, *v_caches):
        if t.device != k0.device or t.shape != k0.shape or t.dtype != k0.dtype:
            raise ValueError(
                f"every K and V tensor must match the first ({tuple(k0.shape)}, {k0.dtype},"
                f" {k0.device}); one is {tuple(t.shape)}, {t.dtype}, {t.device}"
            )
        if not t.is_contiguous():
            raise ValueError("K and V tensors must be contiguous: pages are byte ranges")
    num_pages, page_size, num_kv_heads, head_dim = k0.shape
    dtype = str(k0.dtype).removeprefix("torch.")
    layout = KVLayout(len(k_caches), num_kv_heads, head_dim, dtype, page_size, num_pages)
    aux = AuxPool(num_aux_rows)
    regions = KVRegions(
        layout,
        tuple(int(t.data_ptr()) for t in k_caches),
        tuple(int(t.data_ptr()) for t in v_caches),
        device,
        aux.base_addr,
        num_aux_rows,
    )
    return regions, [aux, *k_caches, *v_caches]


def _pool_device(device: Any) -> str:
    """A torch device as ``KVRegions.device`` names it: ``cpu`` or ``cuda:N``."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    raise ValueError(f"KV tensors on {device}: only CPU and CUDA pools can be registered")
