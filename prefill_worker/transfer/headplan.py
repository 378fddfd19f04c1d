"""Which KV heads a prefill rank writes into which decode rank, and the descriptors that carry
them, when the two sides run different tensor-parallel (TP) sizes. Pure and torch-free.

Both sides slice heads by the one rule, ``kv.heads.kv_head_range``. A prefill rank of TP ``p``
writes, into each decode rank of TP ``d`` whose heads overlap its own, the overlap: one
``HeadSlice`` (a head offset and count on each side). When a head is replicated on several
prefill ranks (fewer KV heads than ``p``), exactly one of them writes it into a given decode
rank (``writer_rank``), so every decode head is written once::

    KV 8, p 1, d 2     prefill 0 [0..7]  ─ heads 0..3 at offset 0 ─▶ decode 0 [0..3]
                                         ─ heads 4..7 at offset 4 ─▶ decode 1 [4..7]
    KV 8, p 2, d 1     prefill 0 [0..3]  ─ at offset 0 ─▶ decode 0 [0..7], its heads 0..3
                       prefill 1 [4..7]  ─ at offset 0 ─▶ decode 0,        its heads 4..7

An MLA pool (``kv.layout`` kind ``mla``) is the replicated one-head case, and this module is
the one place that says which rank writes it: its latent is one "head" (``num_kv_heads`` 1)
that every prefill rank holds byte for byte, so decode rank j of TP d is written by prefill
rank ``j * p // d`` alone, rank 0 alone when d is 1, whole pages each time (SGLang's decode
reads an MLA latent from that one rank too, its ``target_tp_rank``)::

    MLA, p 2, d 1      prefill 0 [latent] ─ whole pages ─▶ decode 0   (prefill 1: nothing)
    MLA, p 2, d 2      prefill 0 [latent] ─ whole pages ─▶ decode 0
                       prefill 1 [latent] ─ whole pages ─▶ decode 1

A page of one layer's K (or V) is ``[page_size, heads, head_dim]``, token-major (both our
pools and SGLang's). A head sub-range of it is therefore ``page_size`` strided runs, one per
token; only a slice that is the whole page on both sides (``p == d``, or replicas) is one run
per page::

    src page (4 local heads)   t0 [h0 h1 h2 h3] t1 [h0 h1 h2 h3] ...
    dst page (2 local heads)   t0 [h2 h3]       t1 [h2 h3]       ...   (heads 2..3: 1 run/token)

So a sliced write costs ``2L * page_size`` descriptors per page, a whole-page one ``2L``
(docs/parallelism.md, "KV transfer across TP sizes", measures it; SGLang's NIXL sender slices
per token the same way; vLLM avoids it by a head-major page layout, which ours is not).

Descriptor lists for slices (``slice_table``), one per side, in the row form NIXL takes
(``pagemap.STRIDED_COLUMNS``)::

    index (r * num_pages + p) * page_size + t   token t of page p of layer-plane r
                                                (r < L: K of layer r, else V of layer r - L),
                                                num_heads * head_dim * itemsize long, starting
                                                head_offset heads into the token

Layer-major pages of a layer are adjacent, so a layer-plane is one row of num_pages *
page_size tokens; page-major ones are not, so it is a row per page (2L * num_pages rows). A
windowed sliding pool's sliding layer-planes hold their own page count
(``KVRegions.layer_pages``), so later planes start earlier: ``transfer.push.window_route``
indexes such a list (``FullPoolWindow`` with ``runs`` page_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import MLA, VLLM_BLOCKS, KVLayout, KVRegions
from prefill_worker.transfer.pagemap import (
    STRIDED_COLUMNS,
    device_id,
    kv_descriptor_table,
    layer_view_table,
    region_indices,
)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads ``[src_head_offset, + num_heads)`` of prefill rank ``src_rank``'s tokens go to
    ``[dst_head_offset, + num_heads)`` of decode rank ``dst_rank``'s; a token holds
    ``src_num_heads`` heads on the prefill side and ``dst_num_heads`` on the decode side."""

    src_rank: int
    dst_rank: int
    src_head_offset: int
    dst_head_offset: int
    num_heads: int
    src_num_heads: int
    dst_num_heads: int

    @property
    def is_whole_page(self) -> bool:
        """The slice is every head of a page on both sides: pages copy whole."""
        return self.num_heads == self.src_num_heads == self.dst_num_heads


def writer_rank(num_kv_heads: int, head: int, dst_rank: int, src_tp: int, dst_tp: int) -> int:
    """The one prefill rank that writes ``head`` into decode rank ``dst_rank``: of the
    prefill ranks holding it (consecutive), the one at the decode rank's position among the
    decode ranks holding it, scaled. So replicas share the writing: at p = d each prefill rank
    writes its own decode rank, and for d >= p decode rank j reads from prefill rank
    j * p // d alone (SGLang's ``target_tp_rank``)."""
    holders = [r for r in range(src_tp) if head in kv_head_range(num_kv_heads, r, src_tp)]
    readers = [j for j in range(dst_tp) if head in kv_head_range(num_kv_heads, j, dst_tp)]
    return holders[readers.index(dst_rank) * len(holders) // len(readers)]


def plan_rank(num_kv_heads: int, src_rank: int, src_tp: int, dst_tp: int) -> tuple[HeadSlice, ...]:
    """What prefill rank ``src_rank`` of ``src_tp`` writes into a decode of ``dst_tp`` ranks:
    one slice per decode rank it feeds, in decode-rank order. ``ValueError`` when either TP
    size does not split (or replicate) the heads."""
    src = kv_head_range(num_kv_heads, src_rank, src_tp)
    slices = []
    for dst_rank in range(dst_tp):
        dst = kv_head_range(num_kv_heads, dst_rank, dst_tp)
        mine = [
            h for h in dst if writer_rank(num_kv_heads, h, dst_rank, src_tp, dst_tp) == src_rank
        ]
        if mine:
            slices.append(_slice(src_rank, dst_rank, src, dst, mine))
    return tuple(slices)


def _slice(src_rank: int, dst_rank: int, src: range, dst: range, heads: list[int]) -> HeadSlice:
    # Both ranges are contiguous and each head has one writer, so ``heads`` is a run.
    assert heads == list(range(heads[0], heads[-1] + 1)), heads
    return HeadSlice(
        src_rank,
        dst_rank,
        heads[0] - src.start,
        heads[0] - dst.start,
        len(heads),
        len(src),
        len(dst),
    )


def plan_group(num_kv_heads: int, src_tp: int, dst_tp: int) -> tuple[HeadSlice, ...]:
    """Every prefill rank's slices, rank by rank (``plan_rank`` of each)."""
    return tuple(s for r in range(src_tp) for s in plan_rank(num_kv_heads, r, src_tp, dst_tp))


def sources_of(num_kv_heads: int, dst_rank: int, src_tp: int, dst_tp: int) -> tuple[int, ...]:
    """The prefill ranks that write into decode rank ``dst_rank``, in order."""
    heads = kv_head_range(num_kv_heads, dst_rank, dst_tp)
    return tuple(sorted({writer_rank(num_kv_heads, h, dst_rank, src_tp, dst_tp) for h in heads}))


def slice_layout_error(local: KVLayout, remote: KVLayout, head_slice: HeadSlice) -> str | None:
    """Why pages of ``local`` cannot be written into ``remote`` by ``head_slice``, or None:
    the two must agree on everything but the heads a token holds (and the pool sizes); an mla
    pool only into an mla pool (its one latent "head" copies whole)."""
    if (local.kind == MLA) != (remote.kind == MLA):
        return f"a pool of kind {local.kind} cannot be written into one of kind {remote.kind}"
    if VLLM_BLOCKS in (local.kind, remote.kind) and (
        local.kind != remote.kind or not head_slice.is_whole_page
    ):  # its pages hold K‖V per head: a head slice is not a token run
        return (
            f"a {local.kind} pool into a {remote.kind} one by {head_slice}: a vllm_blocks "
            "pool is written whole pages into a vllm_blocks pool only (the same TP)"
        )
    ours = (local.num_layers, local.head_dim, local.dtype, local.page_size)
    theirs = (remote.num_layers, remote.head_dim, remote.dtype, remote.page_size)
    if ours != theirs:
        return f"(layers, head_dim, dtype, page_size) differ: ours {ours}, the decode's {theirs}"
    if (local.num_kv_heads, remote.num_kv_heads) != (
        head_slice.src_num_heads,
        head_slice.dst_num_heads,
    ):
        return (
            f"a token holds {local.num_kv_heads} heads here and {remote.num_kv_heads} on the "
            f"decode rank; the plan expects {head_slice.src_num_heads} and "
            f"{head_slice.dst_num_heads}"
        )
    return None


def slice_table(regions: KVRegions, head_offset: int, num_heads: int) -> np.ndarray:
    """One side's list of token runs (module docstring): [rows, 5] strided rows."""
    lay = regions.layout
    head_bytes = lay.head_dim * lay.itemsize
    token_bytes = lay.num_kv_heads * head_bytes
    if not 0 <= head_offset < head_offset + num_heads <= lay.num_kv_heads:
        raise ValueError(f"heads [{head_offset}, +{num_heads}) outside {lay.num_kv_heads}")
    bases = [a + head_offset * head_bytes for a in regions.k_base_addrs + regions.v_base_addrs]
    num_bytes, dev = num_heads * head_bytes, device_id(regions.device)
    counts = regions.layer_pages * 2 or (lay.num_pages,) * len(bases)  # a windowed pool
    if lay.page_stride_bytes == lay.page_bytes:  # a layer's pages are adjacent
        rows = [
            [b, num_bytes, dev, token_bytes, n * lay.page_size]
            for b, n in zip(bases, counts, strict=True)
        ]
    else:
        rows = [
            [b + p * lay.page_stride_bytes, num_bytes, dev, token_bytes, lay.page_size]
            for b, n in zip(bases, counts, strict=True)
            for p in range(n)
        ]
    return np.array(rows, dtype=np.uint64).reshape(len(rows), len(STRIDED_COLUMNS))


def slice_indices(pages: np.ndarray, layout: KVLayout) -> np.ndarray:
    """Indices into ``slice_table`` of every token of ``pages`` in every layer-plane,
    layer-plane-major then page then token: [2L * len(pages) * page_size], int32."""
    page_size, num_planes = layout.page_size, 2 * layout.num_layers
    starts = np.add.outer(
        np.arange(num_planes, dtype=np.int32) * layout.num_pages,
        np.asarray(pages, dtype=np.int32),
    ).ravel()
    return np.add.outer(starts * page_size, np.arange(page_size, dtype=np.int32)).ravel()


def num_descriptors(head_slice: HeadSlice, num_layers: int, page_size: int, num_pages: int) -> int:
    """Descriptors (per side) one slice costs for ``num_pages`` pages: 2L per page whole,
    2L * page_size per page sliced."""
    per_page = 2 * num_layers * (1 if head_slice.is_whole_page else page_size)
    return per_page * num_pages


def write_table(regions: KVRegions, head_offset: int, num_heads: int, is_whole: bool) -> np.ndarray:
    """One side's list for a slice: whole pages per layer-plane (``pagemap.layer_view_table``,
    2L rows, L for an mla pool) when the slice is the whole page, else token runs
    (``slice_table``)."""
    if is_whole and regions.layout.kind == VLLM_BLOCKS:  # L regions of K‖V pages
        return kv_descriptor_table(regions)
    if is_whole:
        return layer_view_table(regions)
    return slice_table(regions, head_offset, num_heads)


def write_indices(pages: np.ndarray, layout: KVLayout, is_whole: bool) -> np.ndarray:
    """Indices into ``write_table``'s list of ``pages``, in the same order on both sides."""
    if is_whole and layout.kind == VLLM_BLOCKS:
        return region_indices(pages, layout.num_regions, layout.num_pages)
    if is_whole:
        return region_indices(pages, layout.planes * layout.num_layers, layout.num_pages)
    return slice_indices(pages, layout)


def decode_rank_error(num_kv_heads: int, tp_rank: int, tp_size: int, heads: range) -> str | None:
    """Why a decode rank that says it is ``tp_rank`` of ``tp_size`` holding ``heads`` cannot
    be written by the rule, or None."""
    try:
        ruled = kv_head_range(num_kv_heads, tp_rank, tp_size)
    except ValueError as exc:
        return f"decode TP {tp_size}: {exc}"
    if heads != ruled:
        return (
            f"decode rank {tp_rank} of {tp_size} says it holds KV heads "
            f"[{heads.start}, {heads.stop}); the rule gives [{ruled.start}, {ruled.stop})"
        )
    return None
