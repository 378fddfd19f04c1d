"""The page table with a windowed sliding pool (``kv.sliding``): a request's sliding entries
are reserved with its pages, trimmed after each chunk and returned on every way out; with a
prefix cache, a released request keeps its cached chain's window, a hit is truncated to a kept
window and starts its entries with it, and evictions (the cache's, or a short reservation's)
drop kept windows."""

from __future__ import annotations

import pytest

from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
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


def test_detach_keeps_the_sliding_pages_until_the_forward_is_collected() -> None:
    """A request that ends while a forward uses its pages (``detach``): its sliding pages, as
    its full pages, stay allocated (nobody gets them, nobody clears them) until
    ``free_detached``; its quota goes back at once."""
    table, pool, sliding_pool = tables()
    assert table.try_reserve("a", list(range(12))) is not None
    entries = table.sliding_pages_for("a", 0, 4)
    detached = table.detach("a")
    assert "a" not in table and "a" not in table.sliding  # type: ignore[operator]
    assert detached.sliding_page_ids == entries and detached.page_ids == tuple(range(6))
    assert sliding_pool.num_used == 2 and pool.num_used == 6
    assert table.sliding.num_available_pages == 6  # type: ignore[union-attr]  # quota back
    table.check_integrity([detached])
    with pytest.raises(AssertionError, match="leaked"):
        table.check_integrity()
    table.free_detached(detached)
    assert sliding_pool.num_free == 8 and pool.num_free == 16
    table.check_integrity()


def cached_tables(
    num_pages: int = 16, num_sliding: int = 8, max_cached: int | None = None
) -> tuple[PageTable, PagePrefixCache, PagePool]:
    pool, sliding_pool = PagePool(num_pages), PagePool(num_sliding)
    sliding = SlidingPageTable(sliding_pool, PS, WINDOW, CHUNK)  # window: 2 positions back
    cache = PagePrefixCache(pool, PS, max_cached)
    return PageTable(pool, PS, cache, sliding), cache, sliding_pool


def prefill(table: PageTable, rid: str, tokens: list[int], hit_tokens: int = 0) -> None:
    """Chunks of CHUNK from the hit on, each consumed before the next (serial forwards)."""
    for start in range(hit_tokens, len(tokens), CHUNK):
        end = min(start + CHUNK, len(tokens))
        entries = table.sliding_pages_for(rid, start, end)
        assert NO_PAGE not in entries[max(0, start - WINDOW + 1) // PS :]
        table.chunk_done(rid, end)


def test_a_released_prompt_keeps_its_window_and_a_longer_prompt_hits_it() -> None:
    table, cache, sliding_pool = cached_tables()
    first = list(range(100, 111))  # 11 tokens: a chain of 5 pages, [0, 10)
    assert table.try_reserve("a", first) is not None
    prefill(table, "a", first)
    window = table.sliding_entries("a")[4:5]  # [8, 10): the window of position 10
    table.release("a")
    assert sliding_pool.num_used == 1 and table.sliding.num_kept_pages == 1  # type: ignore[union-attr]
    assert table.sliding.num_held_pages == 0  # type: ignore[union-attr]  # no request's
    assert sliding_pool.refcount(window[0]) == 1
    table.check_integrity()
    second = [*first[:10], 7, 7, 7, 7, 7]  # shares 5 pages
    full = cache.match(second)
    assert full.num_tokens == 10
    hit = table.lookup(second)
    assert hit == full  # the chain's end: its window is kept
    page_ids = table.try_reserve("b", second, hit)
    assert page_ids is not None and page_ids[:5] == hit.page_ids
    assert table.sliding_entries("b") == (NO_PAGE,) * 4 + window  # shared, not its own
    assert sliding_pool.refcount(window[0]) == 2
    assert table.sliding.num_held_pages == 1  # type: ignore[union-attr]  # b's now too
    assert table.sliding.num_available_pages == 8 - 1 - 6  # type: ignore[union-attr]  # quota 6
    table.check_integrity()
    entries = table.sliding_pages_for("b", 10, 14)  # writes [10, 14): pages of its own
    assert entries[4] == window[0] and window[0] not in entries[5:]
    table.chunk_done("b", 14)  # position 9 falls out: the shared page goes, not its quota
    assert entries[4] not in table.sliding_entries("b")
    table.check_integrity()
    table.sliding_pages_for("b", 14, 15)
    table.chunk_done("b", 15)
    table.release("b")  # its own chain (7 pages) keeps its own window too
    ends = {hit.block_hashes[-1], cache.match([*second, 0]).block_hashes[-1]}
    assert set(table.sliding.window_keys()) == ends  # type: ignore[union-attr]
    table.check_integrity()


def test_a_hit_is_cut_to_the_last_page_whose_window_is_kept() -> None:
    table, cache, _ = cached_tables()
    short, long = list(range(9)), list(range(13))  # chains of 4 and 6 pages
    for rid, tokens in (("short", short), ("long", long)):
        assert table.try_reserve(rid, tokens) is not None
        prefill(table, rid, tokens)
    table.release("short")  # keeps the window of page 4's start
    probe = [*range(11), 5, 5]  # shares 5 pages of long's: no window at 10, one at 8
    assert cache.match(probe).num_tokens == 10
    hit = table.lookup(probe)
    assert hit.num_tokens == 8 and len(hit.page_ids) == len(hit.block_hashes) == 4
    assert hit.num_query_tokens == 13
    assert table.lookup([50, 51, 52]).num_tokens == 0  # no cached page: the cache's miss
    assert table.lookup([0, 1, 99, 99, 99]).num_tokens == 0  # a page, but no window
    table.release("long")
    table.check_integrity()


def test_a_window_goes_with_its_evicted_block() -> None:
    table, cache, sliding_pool = cached_tables()
    tokens = list(range(9))
    assert table.try_reserve("a", tokens) is not None
    prefill(table, "a", tokens)
    table.release("a")
    assert sliding_pool.num_used == 1
    pool = table.pool
    assert cache.try_make_room(pool.num_free + 1)  # one page: the chain's last goes first
    assert sliding_pool.num_used == 0 and table.sliding.window_keys() == ()  # type: ignore[union-attr]
    assert cache.num_pages == 3 and cache.match(tokens).num_tokens == 6
    assert table.lookup(tokens).num_tokens == 0  # three pages cached, but no window
    table.check_integrity()


def test_a_short_reservation_evicts_idle_windows_oldest_first() -> None:
    table, _, sliding_pool = cached_tables(num_pages=64, num_sliding=16)
    prompts = {rid: [n] * 9 for n, rid in enumerate("abcdef")}  # quota 5, a window of 1
    for rid, tokens in prompts.items():
        assert table.try_reserve(rid, tokens) is not None
        prefill(table, rid, tokens)
        table.release(rid)
    keys = table.sliding.window_keys()  # type: ignore[union-attr]
    assert len(keys) == 6 and sliding_pool.num_used == 6
    probe = [*prompts["a"][:8], 1, 2, 3, 4]
    hit = table.lookup(probe)
    assert hit.num_tokens == 8
    assert table.try_reserve("g", probe, hit) is not None  # quota 6: 10 free, 6 promised
    assert table.sliding.window_keys() == (*keys[1:], keys[0])  # type: ignore[union-attr]
    assert table.try_reserve("h", list(range(40))) is not None  # 2 short: b's and c's go
    assert table.sliding.window_keys() == (*keys[3:], keys[0])  # type: ignore[union-attr]
    assert sliding_pool.num_free == 12
    # 6 short: d, e, f would free 3, a's page is g's too: nothing is evicted
    assert table.try_reserve("i", list(range(200, 240))) is None
    assert table.sliding.window_keys() == (*keys[3:], keys[0])  # type: ignore[union-attr]
    table.check_integrity()
    table.release("g")  # its chain is a's: kept already
    table.release("h")  # nothing computed, no chain
    assert table.try_reserve("i", list(range(200, 240))) is not None  # room without evicting
    assert table.sliding.window_keys() == (*keys[3:], keys[0])  # type: ignore[union-attr]
    table.release("i")
    table.check_integrity()


def test_a_window_is_kept_once_and_only_when_whole() -> None:
    table, _, sliding_pool = cached_tables()
    tokens = list(range(9))
    for rid in ("a", "b"):  # the same prompt twice at once: one window
        assert table.try_reserve(rid, tokens) is not None
        prefill(table, rid, tokens)
    table.release("a")
    table.release("b")
    assert len(table.sliding.window_keys()) == 1 and sliding_pool.num_used == 1  # type: ignore[union-attr]
    sliding = table.sliding
    assert sliding is not None
    assert sliding.try_reserve("c", 12)
    entries = sliding.pages_for("c", 4, 8)  # [2, 8): entry 0 not held
    assert entries[0] == NO_PAGE and NO_PAGE not in entries[1:]
    assert not sliding.keep_window("c", 1234, 5)  # beyond its entries
    assert not sliding.keep_window("c", 1234, 1)  # page 0 ([0, 2)) not held
    assert sliding.keep_window("c", 1234, 3)  # page 2: [4, 6)
    assert not sliding.keep_window("c", 1234, 4)  # kept for that block already
    assert sliding.window_keys()[-1] == 1234 and sliding_pool.refcount(entries[2]) == 2
    sliding.release("c")
    assert sliding_pool.num_used == 2
    sliding.forget_windows([1234, 4321])  # an unknown block: nothing
    assert sliding_pool.num_used == 1
    table.check_integrity()


def test_a_speculative_request_keeps_and_hits_windows_too() -> None:
    table, _, _ = cached_tables()
    tokens = list(range(9))
    assert table.try_reserve("a", tokens, speculative=True) is not None
    prefill(table, "a", tokens)
    table.release("a")
    assert table.lookup([*tokens[:8], 5]).num_tokens == 8
    table.check_integrity()


def test_a_detached_request_keeps_no_window() -> None:
    table, _, sliding_pool = cached_tables()
    tokens = list(range(9))
    assert table.try_reserve("a", tokens) is not None
    prefill(table, "a", tokens)
    detached = table.detach("a")
    assert sliding_pool.num_used == len(detached.sliding_page_ids) > 0
    table.free_detached(detached)
    assert sliding_pool.num_used == 0
    assert table.lookup([*tokens[:8], 5]).num_tokens == 0
    table.check_integrity()


def test_integrity_sees_a_window_of_an_uncached_block() -> None:
    table, _, _ = cached_tables()
    tokens = list(range(9))
    assert table.try_reserve("a", tokens) is not None
    prefill(table, "a", tokens)
    assert table.sliding is not None and table.sliding.keep_window("a", 99, 4)
    table.release("a")
    with pytest.raises(AssertionError, match="a window uncached"):
        table.check_integrity()


def test_integrity_sees_a_kept_page_counted_wrong() -> None:
    table, _, sliding_pool = cached_tables()
    tokens = list(range(9))
    assert table.try_reserve("a", tokens) is not None
    prefill(table, "a", tokens)
    table.release("a")
    assert len(table.sliding.window_keys()) == 1  # type: ignore[union-attr]
    sliding_pool.incref([next(p for p in range(8) if sliding_pool.refcount(p))])
    with pytest.raises(AssertionError, match="sliding page"):
        table.check_integrity()


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


def test_no_window_is_kept_for_a_chain_end_evicted_under_the_request() -> None:
    """B computed the same prompt as A, whose pages hold B's chain; A's last page is evicted
    while B runs (idle: A had gone). B's release keeps no window for a block not cached."""
    table, cache, sliding_pool = cached_tables()
    tokens = list(range(9))  # a chain of 4 pages
    for rid in ("a", "b"):
        assert table.try_reserve(rid, tokens) is not None
        prefill(table, rid, tokens)
    table.release("a")
    assert len(table.sliding.window_keys()) == 1  # type: ignore[union-attr]
    assert cache.try_make_room(table.pool.num_free + 1)  # A's last page, and its window
    assert table.sliding.window_keys() == ()  # type: ignore[union-attr]
    table.release("b")
    assert table.sliding.window_keys() == () and sliding_pool.num_used == 0  # type: ignore[union-attr]
    table.check_integrity()
