"""The loopback backend and the page arithmetic every backend shares: the destination
mapping (cached prefix skipped), want checks, and the sender state machine."""

from __future__ import annotations

import numpy as np
import pytest

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxPool, AuxRow
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.testing.loopback import LoopbackBackend
from prefill_worker.transfer import pagemap, wire
from prefill_worker.transfer.base import KVPoll

LAYOUT = KVLayout(3, 2, 4, "float32", 4, 16)  # page_bytes = 4 * 2 * 4 * 4 = 128


class Pool:
    """K and V regions of every layer in one numpy buffer, plus an AuxPool."""

    def __init__(self, seed: int) -> None:
        self.kv = np.random.default_rng(seed).integers(
            0, 256, 2 * 3 * LAYOUT.region_bytes, np.uint8
        )
        self.aux = AuxPool(4)
        base = int(self.kv.ctypes.data)
        starts = tuple(base + i * LAYOUT.region_bytes for i in range(6))
        self.regions = KVRegions(LAYOUT, starts[:3], starts[3:], "cpu", self.aux.base_addr, 4)

    def page(self, region: int, page: int) -> np.ndarray:
        start = region * LAYOUT.region_bytes + page * LAYOUT.page_bytes
        return self.kv[start : start + LAYOUT.page_bytes]


def test_map_pages_skips_the_cached_prefix() -> None:
    # prompt pages 0..5, decode holds 2, wants pages [9, 3, 7, 1] for prompt pages 2..5
    dst = [9, 3, 7, 1]
    src, out = pagemap.map_pages([10, 11, 12], 0, 2, dst)  # prompt pages 0..2
    assert src.tolist() == [12] and out.tolist() == [9]
    src, out = pagemap.map_pages([13, 14, 15], 3, 2, dst)  # prompt pages 3..5
    assert src.tolist() == [13, 14, 15] and out.tolist() == [3, 7, 1]
    src, out = pagemap.map_pages([10], 0, 2, dst)  # entirely cached
    assert src.tolist() == [] and out.tolist() == []
    with pytest.raises(ValueError, match="exceed"):
        pagemap.map_pages([1, 2], 5, 2, dst)


def test_region_indices_are_region_major() -> None:
    idx = pagemap.region_indices(np.array([3, 4]), 3, 16)
    assert idx.tolist() == [3, 4, 19, 20, 35, 36]
    assert idx.dtype == np.int32 and idx.flags.c_contiguous  # what NIXL takes without a copy


def test_descriptor_tables_match_the_layout() -> None:
    pool = Pool(0)
    kv = pagemap.kv_descriptor_table(pool.regions)
    assert kv.shape == (6 * 16, 3)
    i = pagemap.region_indices(np.array([5]), 6, 16)[4]  # V of layer 1, page 5
    assert kv[i, 0] == pool.regions.v_base_addrs[1] + 5 * LAYOUT.page_bytes
    assert kv[i, 1] == LAYOUT.page_bytes
    aux = pagemap.aux_descriptor_table(pool.regions)
    assert aux.shape == (4, 3)
    assert aux[3].tolist() == [pool.aux.base_addr + 3 * AUX_ROW_BYTES, AUX_ROW_BYTES, 0]


@pytest.mark.parametrize(
    ("want", "why"),
    [
        (wire.Want.of(1, (1, 2, 3), 0, 2), "not a multiple"),
        (wire.Want.of(1, (1,), 0, 24), "exceeds the prompt"),
        (wire.Want.of(1, (1, 2), 0, 0), "needs 3"),
        (wire.Want.of(1, (1, 2, 16), 0, 0), "outside the decode pool"),
        (wire.Want.of(1, (1, 2, 2), 0, 0), "repeat"),
        (wire.Want.of(1, (1, 2, 3), 4, 0), "dst_aux_slot"),
    ],
)
def test_check_want_refuses_with_a_reason(want: wire.Want, why: str) -> None:
    assert why in (pagemap.check_want(want, 10, LAYOUT, Pool(0).regions) or "")


def test_check_want_accepts_a_good_want() -> None:
    assert pagemap.check_want(wire.Want.of(1, (7,), 3, 8), 10, LAYOUT, Pool(0).regions) is None


@pytest.mark.parametrize("want_first", [True, False])
def test_loopback_copies_bytes_where_decode_asked(want_first: bool) -> None:
    src, dst = Pool(1), Pool(2)
    before = dst.kv.copy()
    backend = LoopbackBackend(src.regions, dst.regions)
    if want_first:
        backend.want(5, [9, 3, 7], 2, 4)
    sender = backend.create_sender(5, "r", 13)  # 4 pages, 1 cached
    if not want_first:
        assert sender.poll() is KVPoll.BOOTSTRAPPING
        backend.want(5, [9, 3, 7], 2, 4)
    assert sender.poll() is KVPoll.READY and sender.num_cached_tokens() == 4
    sender.send_pages([0, 1], 0)
    sender.send_pages([14, 15], 2)
    row = src.aux.try_alloc()
    assert row is not None
    src.aux.write(row, AuxRow(42, -1.0, 13, 4))
    sender.send_aux(row)
    assert sender.poll() is KVPoll.TRANSFERRING
    backend.poll()
    assert sender.poll() is KVPoll.SUCCESS and backend.told[5] == ("ok", None)
    assert backend.sent[5] == [(1, 9), (14, 3), (15, 7)]
    expect = before.copy()
    for region in range(6):
        for s, d in backend.sent[5]:
            start = region * LAYOUT.region_bytes + d * LAYOUT.page_bytes
            expect[start : start + LAYOUT.page_bytes] = src.page(region, s)
    assert np.array_equal(dst.kv, expect)
    assert dst.aux.read(2) == AuxRow(42, -1.0, 13, 4)
    sender.close()
    assert not backend.senders


def test_loopback_failures_reach_the_decode_side() -> None:
    backend = LoopbackBackend(Pool(0).regions)
    sender = backend.create_sender(1, "r", 8)
    backend.want(1, [0], 0, 0)  # needs 2 pages
    assert sender.poll() is KVPoll.FAILED and "needs 2" in (sender.failure_reason() or "")
    assert backend.told[1][0] == "failed"
    dup = backend.create_sender(1, "r2", 8)
    assert dup.poll() is KVPoll.FAILED and "in use" in (dup.failure_reason() or "")
    sender.close()
    other = backend.create_sender(2, "r", 8)
    backend.want(2, [0, 1], 0, 0)
    backend.abort(2)
    assert other.poll() is KVPoll.ABORTED and backend.told[2][0] == "aborted"
    other.send_pages([0, 1], 0)  # ignored once terminal
    assert 2 not in backend.sent
    other.fail("late")
    assert other.poll() is KVPoll.ABORTED
    other.close()
    assert not backend.senders
    last = backend.create_sender(3, "r", 8)
    last.close()
    assert last.poll() is KVPoll.FAILED and backend.told[3][0] == "failed"
