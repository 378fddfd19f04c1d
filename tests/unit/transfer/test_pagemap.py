"""The page arithmetic every backend shares: the destination mapping (cached prefix skipped),
region-major descriptor indices and tables, and want checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxPool
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import pagemap, wire
from prefill_worker.transfer.validate import DEFAULT_MAX_PEER_PAGES

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
    kv = expand(pagemap.kv_descriptor_table(pool.regions))
    assert pagemap.kv_descriptor_table(pool.regions).shape == (6, 5)  # strided: one per region
    assert kv.shape == (6 * 16, 3)
    i = pagemap.region_indices(np.array([5]), 6, 16)[4]  # V of layer 1, page 5
    assert kv[i, 0] == pool.regions.v_base_addrs[1] + 5 * LAYOUT.page_bytes
    assert kv[i, 1] == LAYOUT.page_bytes
    aux = expand(pagemap.aux_descriptor_table(pool.regions))
    assert aux.shape == (4, 3)
    assert aux[3].tolist() == [pool.aux.base_addr + 3 * AUX_ROW_BYTES, AUX_ROW_BYTES, 0]


def test_a_table_at_the_page_limit_stays_one_row_per_region() -> None:
    """What NIXL is given at registration does not grow with the peer's page count."""
    big = dataclasses.replace(LAYOUT, num_pages=DEFAULT_MAX_PEER_PAGES)
    regions = dataclasses.replace(Pool(0).regions, layout=big, num_aux_rows=2**20)
    assert pagemap.kv_descriptor_table(regions).nbytes == 6 * 5 * 8
    assert pagemap.aux_descriptor_table(regions).nbytes == 5 * 8


def expand(strided: np.ndarray) -> np.ndarray:
    """The (addr, len, dev) descriptors a strided table stands for, in NIXL's index order."""
    rows = [
        [addr + i * stride, length, dev]
        for addr, length, dev, stride, count in strided.tolist()
        for i in range(count)
    ]
    return np.array(rows, dtype=np.uint64)


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
