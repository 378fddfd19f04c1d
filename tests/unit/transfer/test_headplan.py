"""The head-slice write plan (``transfer.headplan``) for prefill TP p and decode TP d in
{1, 2, 4, 8} over 1, 2, 4 and 8 KV heads: every decode head is written exactly once, from a
prefill rank that holds it, at the right offsets; and the descriptor lists and indices it
builds move exactly those bytes (NIXL's strided rows expanded here, the copy done on numpy
buffers), between either pool layout."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import LAYER_MAJOR, MLA, PAGE_MAJOR, KVLayout, KVRegions
from prefill_worker.transfer.headplan import (
    HeadSlice,
    num_descriptors,
    plan_group,
    plan_rank,
    slice_indices,
    slice_layout_error,
    slice_table,
    sources_of,
    write_indices,
    write_table,
    writer_rank,
)
from prefill_worker.transfer.pagemap import layer_view_table, region_indices

SIZES = (1, 2, 4, 8)
CASES = list(itertools.product(SIZES, SIZES, SIZES))  # (num_kv_heads, p, d)
NUM_LAYERS, HEAD_DIM, PAGE_SIZE = 2, 3, 4


@pytest.mark.parametrize(("num_kv_heads", "src_tp", "dst_tp"), CASES)
def test_every_decode_head_is_written_once_from_a_rank_that_holds_it(
    num_kv_heads: int, src_tp: int, dst_tp: int
) -> None:
    written: dict[tuple[int, int], int] = {}
    for s in plan_group(num_kv_heads, src_tp, dst_tp):
        src = kv_head_range(num_kv_heads, s.src_rank, src_tp)
        dst = kv_head_range(num_kv_heads, s.dst_rank, dst_tp)
        assert (s.src_num_heads, s.dst_num_heads) == (len(src), len(dst))
        for i in range(s.num_heads):
            head = src[s.src_head_offset + i]
            assert head == dst[s.dst_head_offset + i]
            written[(s.dst_rank, head)] = written.get((s.dst_rank, head), 0) + 1
        assert s.is_whole_page == (len(src) == len(dst))
    wanted = {(j, h) for j in range(dst_tp) for h in kv_head_range(num_kv_heads, j, dst_tp)}
    assert set(written) == wanted and set(written.values()) == {1}


def test_examples() -> None:
    assert plan_rank(8, 0, 1, 2) == (HeadSlice(0, 0, 0, 0, 4, 8, 4), HeadSlice(0, 1, 4, 0, 4, 8, 4))
    assert plan_group(8, 2, 1) == (HeadSlice(0, 0, 0, 0, 4, 4, 8), HeadSlice(1, 0, 0, 4, 4, 4, 8))
    assert plan_rank(8, 1, 2, 2) == (HeadSlice(1, 1, 0, 0, 4, 4, 4),)
    # Replicas share the writing: KV 1 on two prefill ranks feeds four decode ranks.
    assert [sources_of(1, j, 2, 4) for j in range(4)] == [(0,), (0,), (1,), (1,)]
    assert sources_of(8, 0, 4, 1) == (0, 1, 2, 3)
    assert writer_rank(2, 1, 0, 4, 1) == 2  # head 1 lives on prefill ranks 2 and 3


@pytest.mark.parametrize(("num_kv_heads", "src_tp", "dst_tp"), CASES)
def test_replicas_share_the_writing_as_sglang_targets_ranks(
    num_kv_heads: int, src_tp: int, dst_tp: int
) -> None:
    """For d >= p decode rank j hears from prefill rank j * p // d alone (SGLang's
    ``target_tp_rank``); at p = d that is its own rank, a whole page, however many ranks
    hold each head (with the writing given to the first replica, ranks would sit idle)."""
    if dst_tp < src_tp:
        return
    for j in range(dst_tp):
        assert sources_of(num_kv_heads, j, src_tp, dst_tp) == (j * src_tp // dst_tp,)
    if src_tp == dst_tp:
        for r in range(src_tp):
            (only,) = plan_rank(num_kv_heads, r, src_tp, dst_tp)
            assert (only.dst_rank, only.is_whole_page) == (r, True)


def test_heads_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        plan_rank(3, 0, 1, 2)
    with pytest.raises(ValueError, match="cannot be replicated"):
        plan_rank(2, 0, 3, 1)


def test_descriptor_counts() -> None:
    whole, sliced = plan_rank(8, 0, 2, 2)[0], plan_rank(8, 0, 1, 2)[0]
    assert num_descriptors(whole, 32, 16, 10) == 2 * 32 * 10
    assert num_descriptors(sliced, 32, 16, 10) == 2 * 32 * 16 * 10


def _layout(num_kv_heads: int, kind: str, num_pages: int) -> KVLayout:
    return KVLayout(NUM_LAYERS, num_kv_heads, HEAD_DIM, "float32", PAGE_SIZE, num_pages, kind)


class Pool:
    """A pool of either layout over a numpy buffer; addresses are offsets into it."""

    def __init__(self, layout: KVLayout, values: np.ndarray) -> None:
        # values: [L, 2, num_pages, page_size, heads, head_dim], float32
        self.layout = layout
        if layout.kind == PAGE_MAJOR:
            self.array = np.ascontiguousarray(values.transpose(2, 0, 1, 3, 4, 5))
        else:
            self.array = np.ascontiguousarray(values)
        self.bytes = self.array.view(np.uint8).reshape(-1)
        k = tuple(self._offset(layer, 0) for layer in range(layout.num_layers))
        v = tuple(self._offset(layer, 1) for layer in range(layout.num_layers))
        self.regions = KVRegions(layout, k, v, "cpu", 0, 1)

    def _offset(self, layer: int, plane: int) -> int:
        index = (0, layer, plane) if self.layout.kind == PAGE_MAJOR else (layer, plane, 0)
        return int(np.ravel_multi_index((*index, 0, 0, 0), self.array.shape)) * 4

    def values(self) -> np.ndarray:
        if self.layout.kind == PAGE_MAJOR:
            return self.array.transpose(1, 2, 0, 3, 4, 5)
        return self.array


def _expand(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NIXL's reading of strided rows: entry i of a row at addr + i * stride."""
    addrs = [int(a) + i * int(stride) for a, _, _, stride, n in table for i in range(int(n))]
    lens = [int(length) for _, length, _, _, n in table for _ in range(int(n))]
    return np.array(addrs), np.array(lens)


def _copy(src: Pool, s_table, s_idx, dst: Pool, d_table, d_idx) -> None:  # type: ignore[no-untyped-def]
    (s_addr, s_len), (d_addr, d_len) = _expand(s_table), _expand(d_table)
    assert len(s_idx) == len(d_idx)
    for i, j in zip(s_idx, d_idx, strict=True):
        assert s_len[i] == d_len[j]
        n = int(s_len[i])
        dst.bytes[d_addr[j] : d_addr[j] + n] = src.bytes[s_addr[i] : s_addr[i] + n]


def _write(
    s: HeadSlice, src: Pool, dst: Pool, src_pages: np.ndarray, dst_pages: np.ndarray
) -> None:
    assert slice_layout_error(src.layout, dst.layout, s) is None
    if s.is_whole_page:
        n = 2 * NUM_LAYERS
        tables = (layer_view_table(src.regions), layer_view_table(dst.regions))
        indices = (
            region_indices(src_pages, n, src.layout.num_pages),
            region_indices(dst_pages, n, dst.layout.num_pages),
        )
    else:
        tables = (
            slice_table(src.regions, s.src_head_offset, s.num_heads),
            slice_table(dst.regions, s.dst_head_offset, s.num_heads),
        )
        indices = (slice_indices(src_pages, src.layout), slice_indices(dst_pages, dst.layout))
    _copy(src, tables[0], indices[0], dst, tables[1], indices[1])


@pytest.mark.parametrize(
    ("num_kv_heads", "src_tp", "dst_tp"),
    [(8, 1, 4), (8, 2, 1), (4, 4, 2), (2, 1, 4), (1, 2, 4), (8, 8, 2)],
)
@pytest.mark.parametrize(
    ("src_kind", "dst_kind"),
    [(LAYER_MAJOR, LAYER_MAJOR), (PAGE_MAJOR, LAYER_MAJOR), (LAYER_MAJOR, PAGE_MAJOR)],
)
def test_the_lists_move_exactly_the_planned_bytes(
    num_kv_heads: int, src_tp: int, dst_tp: int, src_kind: str, dst_kind: str
) -> None:
    rng = np.random.default_rng(num_kv_heads * 100 + src_tp * 10 + dst_tp)
    src_num_pages, dst_num_pages = 5, 7
    full = rng.standard_normal(
        (NUM_LAYERS, 2, src_num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM), dtype=np.float32
    )
    src_pages, dst_pages = np.array([4, 1, 2]), np.array([0, 6, 3])
    prefill = [
        Pool(
            _layout(len(heads := kv_head_range(num_kv_heads, r, src_tp)), src_kind, src_num_pages),
            full[:, :, :, :, heads.start : heads.stop],
        )
        for r in range(src_tp)
    ]
    decode = []
    for j in range(dst_tp):
        num_local = len(kv_head_range(num_kv_heads, j, dst_tp))
        shape = (NUM_LAYERS, 2, dst_num_pages, PAGE_SIZE, num_local, HEAD_DIM)
        decode.append(
            Pool(_layout(num_local, dst_kind, dst_num_pages), np.zeros(shape, np.float32))
        )
    for s in plan_group(num_kv_heads, src_tp, dst_tp):
        _write(s, prefill[s.src_rank], decode[s.dst_rank], src_pages, dst_pages)
    for j, pool in enumerate(decode):
        heads = kv_head_range(num_kv_heads, j, dst_tp)
        got = pool.values()[:, :, dst_pages]
        assert np.array_equal(got, full[:, :, src_pages][:, :, :, :, heads.start : heads.stop])
        untouched = np.setdiff1d(np.arange(dst_num_pages), dst_pages)
        assert not pool.values()[:, :, untouched].any()


def test_layouts_that_differ_beyond_the_heads_are_refused() -> None:
    s = plan_rank(8, 0, 1, 2)[0]
    ours = _layout(8, LAYER_MAJOR, 4)
    assert slice_layout_error(ours, _layout(4, PAGE_MAJOR, 9), s) is None
    assert "heads" in str(slice_layout_error(ours, _layout(2, LAYER_MAJOR, 9), s))
    other = KVLayout(NUM_LAYERS, 4, HEAD_DIM, "float32", PAGE_SIZE * 2, 9)
    assert "page_size" in str(slice_layout_error(ours, other, s))
    mla = KVLayout(NUM_LAYERS, 1, HEAD_DIM, "float32", PAGE_SIZE, 9, MLA)
    assert "mla" in str(slice_layout_error(ours, mla, s))
    one_head = plan_rank(1, 0, 2, 1)[0]
    assert slice_layout_error(mla, _layout(1, LAYER_MAJOR, 9), one_head) == (
        "a pool of kind mla cannot be written into one of kind layer_major"
    )
    assert "head_dim" in str(slice_layout_error(mla, dataclasses.replace(mla, head_dim=8), s))


def test_an_mla_latent_is_the_replicated_one_head_case() -> None:
    """One writer per decode rank: rank 0 alone into a decode of TP 1; at d > 1 decode rank
    j from prefill rank j * p // d (SGLang's ``target_tp_rank``); whole pages each time."""
    assert plan_group(1, 2, 1) == (HeadSlice(0, 0, 0, 0, 1, 1, 1),)
    assert plan_rank(1, 1, 2, 1) == ()
    assert plan_group(1, 2, 2) == (HeadSlice(0, 0, 0, 0, 1, 1, 1), HeadSlice(1, 1, 0, 0, 1, 1, 1))
    assert [sources_of(1, j, 4, 2) for j in range(2)] == [(0,), (2,)]
    assert all(s.is_whole_page for s in plan_group(1, 4, 8))


def test_an_mla_pool_copies_whole_latent_pages() -> None:
    """``write_table``/``write_indices`` of an mla pool (one plane per layer, no V) move the
    latent pages asked for and nothing else."""
    rng = np.random.default_rng(7)
    src_num_pages, dst_num_pages = 5, 7
    src_array = rng.standard_normal((NUM_LAYERS, src_num_pages, PAGE_SIZE, 1, HEAD_DIM))
    src_array = src_array.astype(np.float32)
    dst_array = np.zeros((NUM_LAYERS, dst_num_pages, PAGE_SIZE, 1, HEAD_DIM), np.float32)
    pools = []
    for array in (src_array, dst_array):
        layout = KVLayout(NUM_LAYERS, 1, HEAD_DIM, "float32", PAGE_SIZE, array.shape[1], MLA)
        layer_bytes = array[0].nbytes
        k = tuple(layer * layer_bytes for layer in range(NUM_LAYERS))
        regions = KVRegions(layout, k, (), "cpu", 0, 1)
        pools.append((array.view(np.uint8).reshape(-1), regions))
    (src_bytes, src), (dst_bytes, dst) = pools
    s = plan_rank(1, 0, 2, 1)[0]
    assert slice_layout_error(src.layout, dst.layout, s) is None
    src_pages, dst_pages = np.array([4, 1, 2]), np.array([0, 6, 3])
    tables = [write_table(r, 0, 1, s.is_whole_page) for r in (src, dst)]
    indices = [
        write_indices(pages, r.layout, s.is_whole_page)
        for pages, r in ((src_pages, src), (dst_pages, dst))
    ]
    (s_addr, s_len), (d_addr, d_len) = _expand(tables[0]), _expand(tables[1])
    assert len(indices[0]) == len(indices[1]) == NUM_LAYERS * len(src_pages)
    for i, j in zip(*indices, strict=True):
        assert s_len[i] == d_len[j]
        dst_bytes[d_addr[j] : d_addr[j] + d_len[j]] = src_bytes[s_addr[i] : s_addr[i] + s_len[i]]
    assert np.array_equal(dst_array[:, dst_pages], src_array[:, src_pages])
    untouched = np.setdiff1d(np.arange(dst_num_pages), dst_pages)
    assert not dst_array[:, untouched].any()


def test_a_head_range_outside_the_token_is_refused() -> None:
    pool = Pool(
        _layout(2, LAYER_MAJOR, 2), np.zeros((NUM_LAYERS, 2, 2, PAGE_SIZE, 2, HEAD_DIM), np.float32)
    )
    with pytest.raises(ValueError, match="outside"):
        slice_table(pool.regions, 1, 2)
