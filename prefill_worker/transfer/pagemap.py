"""Page arithmetic shared by every backend: checking a ``want``, mapping local pages to the
decode peer's pages, and turning pages into descriptor indices.

Each side prepares two descriptor lists once (local, and per decode peer), region-major over
the layout's regions (``kv.layout``), given to NIXL strided: one row per region, so preparing
a peer's lists costs the same at any pool size (docs/protocol.md, ``transfer.max_peer_pages``)::

    KV list   index r * num_pages + p    page p of region r, region_page_bytes long
              layer_major: 2L regions    K of layers 0..L-1, then V of layers 0..L-1
              page_major:  1 region      the whole page: every layer's K and V
              mla:         L regions     the latent of layers 0..L-1 (no V)
    aux list  index row                  aux row `row`, always host memory (DRAM)

A run of adjacent pages is a run of adjacent indices, which NIXL merges into one descriptor
when both sides are adjacent in memory. The aux rows are a list of their own because one NIXL
list holds one memory type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from msgspec import UNSET

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import PAGES, StateComponent, StateRegions
from prefill_worker.transfer.state_guard import STATE_UNSUPPORTED
from prefill_worker.transfer.wire import Want


def num_prompt_pages(num_prompt_tokens: int, page_size: int) -> int:
    return -(-num_prompt_tokens // page_size)


def num_want_pages(num_prompt_tokens: int, num_cached_tokens: int, page_size: int) -> int:
    """How many ``dst_page_ids`` a ``want`` names: the prompt's pages after the cached prefix
    (``num_cached_tokens`` is a multiple of ``page_size``; ``ValueError`` otherwise)."""
    if num_prompt_tokens < 1 or page_size < 1:
        raise ValueError(
            f"num_prompt_tokens ({num_prompt_tokens}) and page_size ({page_size}) must be >= 1"
        )
    if not 0 <= num_cached_tokens <= num_prompt_tokens or num_cached_tokens % page_size:
        raise ValueError(
            f"num_cached_tokens {num_cached_tokens} must be a multiple of {page_size} "
            f"in [0, {num_prompt_tokens}]"
        )
    return num_prompt_pages(num_prompt_tokens, page_size) - num_cached_tokens // page_size


def check_want(
    want: Want, num_prompt_tokens: int, local: KVLayout, remote: KVRegions
) -> str | None:
    """Why the decode peer's ``want`` cannot be served for this prompt, or None if it can."""
    page_size = local.page_size
    if want.num_cached_tokens < 0 or want.num_cached_tokens % page_size:
        return f"num_cached_tokens {want.num_cached_tokens} is not a multiple of {page_size}"
    if want.num_cached_tokens > num_prompt_tokens:
        return (
            f"num_cached_tokens {want.num_cached_tokens} exceeds the prompt ({num_prompt_tokens})"
        )
    needed = num_prompt_pages(num_prompt_tokens, page_size) - want.num_cached_tokens // page_size
    if want.num_dst_pages != needed:
        return f"want names {want.num_dst_pages} pages, the prompt needs {needed}"
    ids = want.dst_page_ids  # checked against the prompt first: at most its page count
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= remote.layout.num_pages):
        return f"dst_page_ids outside the decode pool of {remote.layout.num_pages} pages"
    if np.unique(ids).size != ids.size:
        return "dst_page_ids repeat a page"
    if not 0 <= want.dst_aux_slot < remote.num_aux_rows:
        return f"dst_aux_slot {want.dst_aux_slot} outside 0..{remote.num_aux_rows - 1}"
    return None


def check_want_state(
    want: Want, local: StateComponent | None, remote: StateRegions | None
) -> str | None:
    """Why the ``want`` cannot receive this model's state (``local``; None: a model without
    state, nothing to check) into the decode's pool (``remote``, as it registered), or None.
    A decode that registered no state, or names no slot, is told ``state_unsupported``."""
    if local is None:
        return None
    if remote is None:
        return (
            f"{STATE_UNSUPPORTED}: the decode registered no {local.kind} state, which this "
            "model's decode needs beside the KV (hybrid models: docs/models.md)"
        )
    if local.copy == PAGES:  # written into the want's own pages: they must be in its pool
        return _check_state_pages(want, remote.component.num_items)
    slot = want.dst_state_slot
    if not isinstance(slot, int):
        return f"{STATE_UNSUPPORTED}: the want names no dst_state_slot for the {local.kind} state"
    num_items = remote.component.num_items
    if not 0 <= slot < num_items:
        return f"dst_state_slot {slot} outside 0..{num_items - 1}"
    return None


def _check_state_pages(want: Want, num_items: int) -> str | None:
    """A paged component (a DSA model's index keys) lands in the want's ``dst_page_ids``."""
    if want.dst_state_slot is not UNSET:
        return "dst_state_slot: a paged state component lands in dst_page_ids, not a slot"
    ids = want.dst_page_ids
    if ids.size and int(ids.max()) >= num_items:
        return f"dst_page_ids outside the decode's state pool of {num_items} pages"
    return None


def map_pages(
    page_ids: Sequence[int],
    first_page: int,
    num_cached_pages: int,
    dst_page_ids: Sequence[int] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(local pages, decode pages) for prompt pages [first_page, first_page + len(page_ids)),
    skipping the ones the decode peer already holds."""
    skip = min(len(page_ids), max(0, num_cached_pages - first_page))
    src = np.asarray(page_ids[skip:], dtype=np.int64)
    start = first_page + skip - num_cached_pages
    dst = np.asarray(dst_page_ids[start : start + len(src)], dtype=np.int64)
    if len(dst) != len(src):
        raise ValueError(f"prompt pages up to {first_page + len(page_ids)} exceed the want")
    return src, dst


def region_indices(pages: np.ndarray, num_regions: int, num_pages: int) -> np.ndarray:
    """Descriptor indices of ``pages`` in every region, region-major: [num_regions * len].

    int32 throughout (what NIXL takes; the descriptor table is far below 2**31 entries), one
    outer add and no temporary copies: this runs once per chunk on the engine loop."""
    base = np.arange(0, num_regions * num_pages, num_pages, dtype=np.int32)
    return np.add.outer(base, np.asarray(pages, dtype=np.int32)).ravel()


AUX_MEM_TYPE = "DRAM"  # aux rows live in host memory on every device, both sides
STRIDED_COLUMNS = ("addr", "len", "dev", "stride", "count")  # a row of NIXL's strided list


def kv_descriptor_table(regions: KVRegions) -> np.ndarray:
    """The KV pool's list, as above: [num_regions, 5] strided rows (``STRIDED_COLUMNS``)."""
    return _page_runs(regions, regions.region_base_addrs, regions.layout.region_page_bytes)


def layer_view_table(regions: KVRegions) -> np.ndarray:
    """The pool seen per layer, whatever its layout: [2L, 5] strided rows, so index
    r * num_pages + p is page p of K of layer r (r < L) or of V of layer r - L, ``page_bytes``
    long ([L, 5], each layer's latent, for an mla pool). It is ``kv_descriptor_table`` for a
    layer-major or mla pool; for a page-major one it is what a peer with per-layer buffers
    (an SGLang decode) is written from."""
    bases = regions.k_base_addrs + regions.v_base_addrs
    return _page_runs(regions, bases, regions.layout.page_bytes)


def _page_runs(regions: KVRegions, bases: tuple[int, ...], num_bytes: int) -> np.ndarray:
    """One strided row per base: ``num_bytes`` at every page, a page ``page_stride_bytes``
    after the one before it, in either layout."""
    lay = regions.layout
    counts = regions.layer_pages * 2 or (lay.num_pages,) * len(bases)  # a windowed pool
    rows = [
        [base, num_bytes, device_id(regions.device), lay.page_stride_bytes, count]
        for base, count in zip(bases, counts, strict=True)
    ]
    return np.array(rows, dtype=np.uint64).reshape(len(bases), len(STRIDED_COLUMNS))


def aux_descriptor_table(regions: KVRegions) -> np.ndarray:
    """The aux rows' list: one strided row, ``num_aux_rows`` rows of ``AUX_ROW_BYTES`` in
    host memory."""
    row = [regions.aux_base_addr, AUX_ROW_BYTES, 0, AUX_ROW_BYTES, regions.num_aux_rows]
    return np.array([row], dtype=np.uint64)


def device_id(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"
