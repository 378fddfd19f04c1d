"""PagePool and PageTable: contiguous allocation, refcounts, no-space as None, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxPool, AuxRow
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.tables import PageTable, num_pages_for


def test_fresh_pool_hands_out_one_contiguous_run() -> None:
    pool = PagePool(10)
    assert pool.try_alloc(4) == [0, 1, 2, 3]
    assert pool.try_alloc(3) == [4, 5, 6]
    assert pool.num_free == 3 and pool.num_used == 7
    pool.check_integrity()


def test_no_space_is_none_and_changes_nothing() -> None:
    pool = PagePool(4)
    assert pool.try_alloc(3) is not None
    assert pool.try_alloc(2) is None
    assert pool.num_free == 1
    pool.check_integrity()


def test_best_fit_prefers_a_whole_run_over_splitting_a_bigger_one() -> None:
    pool = PagePool(12)
    a, b, c, d = pool.try_alloc(2), pool.try_alloc(3), pool.try_alloc(2), pool.try_alloc(5)
    assert a and b and c and d
    pool.free(b)  # free runs: [2, 5)
    pool.free(d)  # and [7, 12)
    assert pool.try_alloc(3) == [2, 3, 4]  # the exact fit, not the head of [7, 12)
    pool.check_integrity()


def test_fragmented_pool_stitches_largest_runs_first() -> None:
    pool = PagePool(10)
    pages = pool.try_alloc(10)
    assert pages is not None
    pool.free([0, 1, 4, 5, 6, 9])  # runs [0,2) [4,7) [9,10)
    got = pool.try_alloc(5)
    assert got == [4, 5, 6, 0, 1]
    assert pool.num_free_runs == 1
    pool.check_integrity()


def test_freeing_merges_neighbours_into_one_run() -> None:
    pool = PagePool(6)
    pages = pool.try_alloc(6)
    assert pages is not None
    for page_id in (1, 3, 2, 0, 5, 4):
        pool.free([page_id])
        pool.check_integrity()
    assert pool.num_free_runs == 1 and pool.try_alloc(6) == list(range(6))


def test_refcounts_keep_shared_pages_until_the_last_owner_frees() -> None:
    pool = PagePool(4)
    pages = pool.try_alloc(2)
    assert pages is not None
    pool.incref(pages)
    pool.free(pages)
    assert pool.num_free == 2 and pool.refcount(pages[0]) == 1
    pool.free(pages)
    assert pool.num_free == 4
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(pages)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=60))
def test_random_alloc_free_keeps_the_pool_whole(ops: list[tuple[bool, int]]) -> None:
    pool = PagePool(24)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = pool.try_alloc(n)
            assert (got is None) == (n > pool.num_free + (len(got) if got else 0))
            if got is not None:
                assert len(got) == n == len(set(got))
                held.append(got)
        elif held:
            pool.free(held.pop(n % len(held)))
        pool.check_integrity()
        assert pool.num_used == sum(map(len, held))


def test_table_reserves_whole_prompts_and_releases_them() -> None:
    pool = PagePool(8)
    table = PageTable(pool, page_size=4)
    assert num_pages_for(9, 4) == 3 and table.can_ever_fit(32) and not table.can_ever_fit(33)
    assert table.try_reserve("a", range(9)) == (0, 1, 2)
    assert table.try_reserve("b", range(24)) is None  # 6 pages, 5 free: wait
    assert table.try_reserve("b", range(20)) == (3, 4, 5, 6, 7)
    table.check_integrity()
    table.release("a")
    assert "a" not in table and len(table) == 1 and pool.num_free == 3
    detached = table.detach("b")
    table.check_integrity([detached])
    with pytest.raises(AssertionError, match="leaked"):
        table.check_integrity()
    table.free_detached(detached)
    table.check_integrity()


def test_aux_pool_rows_return() -> None:
    aux = AuxPool(2)
    rows = [aux.try_alloc(), aux.try_alloc()]
    assert None not in rows and aux.try_alloc() is None
    aux.free(rows[0])  # type: ignore[arg-type]
    aux.check_integrity()
    assert aux.num_free == 1


def test_aux_rows_carry_the_computed_count_and_read_old_rows() -> None:
    row = AuxRow(17, -0.5, 40, 8, num_computed_tokens=16)
    packed = row.pack()
    assert len(packed) == AUX_ROW_BYTES and AuxRow.unpack(packed) == row
    assert row.num_prefix_hit_tokens == 24
    assert packed[24:28] == (16).to_bytes(4, "little") and packed[28:] == bytes(4)
    old = packed[:24] + bytes(8)  # a worker before the prefix cache left offset 24 zero
    assert AuxRow.unpack(old).num_computed_tokens == 0
    assert AuxRow.unpack(old).num_prefix_hit_tokens is None
