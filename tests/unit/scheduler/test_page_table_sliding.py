"""The page table with a windowed sliding pool (``kv.sliding``): a request's sliding entries
are reserved with its pages, trimmed after each chunk and returned on every way out."""

from __future__ import annotations

import pytest

from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.prefix_cache import NoPrefixCache
from prefill_worker.kv.sliding import NO_PAGE, SlidingPageTable
from prefill_worker.kv.tables import PageTable

PS, WINDOW, CHUNK = 2, 3, 4


def tables(num_pages: int = 16, num_sliding: int = 8) -> tuple[PageTable, PagePool, PagePool]:
    pool, sliding_pool = PagePool(num_pages), PagePool(num_sliding)
    sliding = SlidingPageTable(sliding_pool, PS, WINDOW, CHUNK)  # quota 6 (2 + 8 tokens)
    return PageTable(pool, PS, None, sliding), pool, sliding_pool


def test_without_a_sliding_pool_a_chunk_has_no_entries() -> None:
    table = PageTable(PagePool(4), PS)
    assert table.try_reserve("a", [1, 2, 3]) is not None
    assert table.sliding_pages_for("a", 0, 3) == ()
    assert table.sliding_entries("a") == ()
    table.chunk_done("a", 3)
    table.release("a")
    table.check_integrity()


def test_entries_grow_per_chunk_and_shrink_after_it() -> None:
    table, pool, sliding_pool = tables()
    assert table.try_reserve("a", list(range(12))) is not None
    first = table.sliding_pages_for("a", 0, 4)
    assert len(first) == 2 and NO_PAGE not in first
    assert table.sliding_entries("a") == first
    table.chunk_done("a", 4)  # later queries see positions >= 2: page 0 goes back
    assert sliding_pool.num_used == 1
    assert table.sliding_entries("a") == (NO_PAGE, first[1])  # what a send reads
    assert table.sliding_pages_for("a", 4, 8)[0] == NO_PAGE
    table.chunk_done("a", 8)
    table.sliding_pages_for("a", 8, 12)
    table.chunk_done("a", 12)  # the last window: positions [10, 12), page 5
    assert [i for i, p in enumerate(table.sliding.get("a")) if p != NO_PAGE] == [5]  # type: ignore[union-attr]
    assert table.cache.num_pages == 0  # no prefix cache beside a sliding pool
    table.check_integrity()
    table.release("a")
    assert pool.num_free == 16 and sliding_pool.num_free == 8
    table.check_integrity()


def test_short_of_sliding_quota_reserves_nothing() -> None:
    table, pool, _ = tables(num_pages=64, num_sliding=9)
    assert table.try_reserve("a", list(range(40))) is not None  # quota 6 of 9
    assert table.try_reserve("b", list(range(40))) is None
    assert "b" not in table and pool.num_used == 20 and table.sliding.num_available_pages == 3  # type: ignore[union-attr]
    assert table.try_reserve("c", list(range(6))) is not None  # 3 pages: its whole prompt
    table.release("a")
    table.release("c")
    table.check_integrity()


def test_short_of_full_pages_gives_the_sliding_quota_back() -> None:
    table, _, _ = tables(num_pages=4)
    assert table.try_reserve("a", list(range(10))) is None  # 5 pages of 4
    assert table.sliding.num_available_pages == 8  # type: ignore[union-attr]
    assert "a" not in table.sliding  # type: ignore[operator]
    table.check_integrity()


def test_detach_returns_the_sliding_pages_at_once() -> None:
    table, pool, sliding_pool = tables()
    assert table.try_reserve("a", list(range(12))) is not None
    table.sliding_pages_for("a", 0, 4)
    page_ids = table.detach("a")
    assert sliding_pool.num_free == 8 and pool.num_used == 6
    table.check_integrity([page_ids])
    table.free_detached(page_ids)
    table.check_integrity()


def test_a_prefix_cache_beside_a_sliding_pool_is_refused() -> None:
    pool = PagePool(8)
    sliding = SlidingPageTable(PagePool(8), PS, WINDOW, CHUNK)
    with pytest.raises(AssertionError, match="bypasses the prefix cache"):
        PageTable(pool, PS, PagePrefixCache(pool, PS), sliding)
    PageTable(pool, PS, NoPrefixCache(pool), sliding).check_integrity()


def test_a_sliding_pool_smaller_than_one_quota_is_refused() -> None:
    with pytest.raises(ValueError, match="need 6"):
        SlidingPageTable(PagePool(5), PS, WINDOW, CHUNK)


def test_integrity_sees_a_leaked_sliding_page() -> None:
    table, _, sliding_pool = tables()
    assert table.try_reserve("a", list(range(4))) is not None
    table.sliding_pages_for("a", 0, 4)
    sliding_pool.try_alloc(1)  # nobody's
    with pytest.raises(AssertionError, match="leaked"):
        table.check_integrity()
