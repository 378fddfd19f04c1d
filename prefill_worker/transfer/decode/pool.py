"""A decode pool given as torch tensors, described as regions (``KVReceiver.from_tensors``).

Checks that every K and V tensor matches the first and lies where the pool layout puts it
(``kv.layout``: contiguous per layer for ``layer_major``; for ``page_major`` the per-layer
views ``pool[:, l, 0]`` / ``pool[:, l, 1]`` of one ``[num_pages, L, 2, page_size, KV, D]``
tensor; for ``mla`` one contiguous latent tensor ``[num_pages, page_size, 1, latent]`` per
layer and no V; the kind is read from their page stride, or no V tensors, unless given),
derives the layout from their shape, and allocates the aux rows in host memory:
numpy for a CPU pool, pinned (page-locked) torch memory for a CUDA pool; either way
registered as DRAM. Imports torch only for a CUDA pool's pinned rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxPool
from prefill_worker.kv.layout import (
    KV_KINDS,
    LAYER_MAJOR,
    MLA,
    PAGE_MAJOR,
    KVLayout,
    KVRegions,
)


def regions_from_tensors(
    k_caches: Sequence[Any],
    v_caches: Sequence[Any],
    num_aux_rows: int,
    pool_layout: str | None = None,
) -> tuple[KVRegions, list[Any]]:
    """The regions of per-layer tensors [num_pages, page_size, num_kv_heads, head_dim], all
    on one device; and the buffers the receiver must keep alive (aux rows first). Unset,
    ``pool_layout`` is read from the tensors (no V: mla, the latents in ``k_caches``; one
    page apart: layer-major; every layer's K and V: page-major).

    ``ValueError`` with the reason when the tensors cannot be one pool of ``pool_layout``."""
    if pool_layout is None:
        pool_layout = _inferred_layout(k_caches, v_caches)
    if pool_layout not in KV_KINDS:
        raise ValueError(f"pool_layout {pool_layout!r} is not one of {', '.join(KV_KINDS)}")
    _check_planes(k_caches, v_caches, pool_layout)
    if num_aux_rows < 1:
        raise ValueError(f"num_aux_rows must be at least 1 (got {num_aux_rows})")
    layout = _layout(k_caches, v_caches, pool_layout)
    device = pool_device(k_caches[0].device)
    aux_addr, aux_buffer = _aux_rows(num_aux_rows, device)
    regions = KVRegions(  # raises ValueError when the addresses are not one such pool
        layout,
        tuple(int(t.data_ptr()) for t in k_caches),
        tuple(int(t.data_ptr()) for t in v_caches),
        device,
        aux_addr,
        num_aux_rows,
    )
    return regions, [aux_buffer, *k_caches, *v_caches]


def _check_planes(k_caches: Sequence[Any], v_caches: Sequence[Any], pool_layout: str) -> None:
    if pool_layout == MLA and (not k_caches or v_caches):
        raise ValueError(
            f"an mla pool is one latent tensor per layer and no V (got {len(k_caches)} "
            f"and {len(v_caches)})"
        )
    if pool_layout != MLA and (not k_caches or len(k_caches) != len(v_caches)):
        raise ValueError(
            f"one K and one V tensor per layer (got {len(k_caches)} and {len(v_caches)})"
        )


def _layout(k_caches: Sequence[Any], v_caches: Sequence[Any], pool_layout: str) -> KVLayout:
    k0 = k_caches[0]
    if k0.dim() != 4:
        raise ValueError(
            f"K and V tensors are [num_pages, page_size, num_kv_heads, head_dim]; "
            f"got {tuple(k0.shape)}"
        )
    for t in (*k_caches, *v_caches):
        if t.device != k0.device or t.shape != k0.shape or t.dtype != k0.dtype:
            raise ValueError(
                f"every K and V tensor must match the first ({tuple(k0.shape)}, {k0.dtype},"
                f" {k0.device}); one is {tuple(t.shape)}, {t.dtype}, {t.device}"
            )
    num_pages, page_size, num_kv_heads, head_dim = k0.shape
    dtype = str(k0.dtype).removeprefix("torch.")
    layout = KVLayout(
        len(k_caches), num_kv_heads, head_dim, dtype, page_size, num_pages, pool_layout
    )
    page_elems = page_size * num_kv_heads * head_dim
    want = (layout.page_stride_bytes // layout.itemsize, num_kv_heads * head_dim, head_dim, 1)
    for t in (*k_caches, *v_caches):
        strides = tuple(t.stride())
        if strides != want and not (num_pages == 1 and strides[1:] == want[1:]):
            raise ValueError(
                f"a {pool_layout} pool's per-layer K/V views have strides {want} "
                f"(pages {want[0] // page_elems} layer-pages apart); one has {strides}"
            )
    return layout


def _inferred_layout(k_caches: Sequence[Any], v_caches: Sequence[Any]) -> str:
    """Mla when there are latents and no V; page-major when the first K's pages are 2L
    layer-pages apart; else layer-major (which ``_layout`` then checks)."""
    if k_caches and not v_caches:
        return MLA
    k0 = k_caches[0] if k_caches else None
    if k0 is not None and k0.dim() == 4 and k0.shape[0] > 1:
        page_elems = k0.shape[1] * k0.shape[2] * k0.shape[3]
        if k0.stride(0) == 2 * len(k_caches) * page_elems:
            return PAGE_MAJOR
    return LAYER_MAJOR


def _aux_rows(num_aux_rows: int, device: str) -> tuple[int, Any]:
    """(address, buffer) of the aux rows: numpy on a CPU pool, pinned torch memory on CUDA."""
    if device == "cpu":
        pool = AuxPool(num_aux_rows)
        return pool.base_addr, pool
    import torch  # a CUDA pool came as torch tensors

    pinned = torch.zeros(num_aux_rows * AUX_ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    return int(pinned.data_ptr()), pinned


def pool_device(device: Any) -> str:
    """A torch device as ``KVRegions.device`` names it: ``cpu`` or ``cuda:N``."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    raise ValueError(f"KV tensors on {device}: only CPU and CUDA pools can be registered")
