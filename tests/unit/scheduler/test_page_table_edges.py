"""The page table's rarer paths (found unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import pytest

from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.tables import PageTable

PS = 2


def test_a_page_size_of_0_is_refused() -> None:
    with pytest.raises(AssertionError):
        PageTable(PagePool(4), 0)


def test_a_prompt_whose_chain_broke_stores_no_more_pages_even_when_room_appears() -> None:
    """The cache holds 2 pages. B's first page and A's first fill it while both run; A's
    second page finds nothing idle to evict, so A's chain breaks there. B finishes (its page
    goes idle), and A's third page is committed: A stores nothing more."""
    pool = PagePool(8)
    table = PageTable(pool, PS, PagePrefixCache(pool, PS, max_pages=2))
    b_prompt, a_prompt = [9, 9, 9], [1, 2, 3, 4, 5, 6, 7]
    assert table.try_reserve("b", b_prompt) is not None
    table.commit("b", 2)
    assert table.try_reserve("a", a_prompt) is not None
    table.commit("a", 2)
    table.commit("a", 4)  # at the cap, nothing idle: the chain breaks after page 0
    assert table.cache.num_pages == 2
    table.release("b")
    assert table.cache.num_evictable == 1
    table.commit("a", 6)
    assert table.cache.num_evictable == 1  # B's page was not evicted for A's later pages
    assert table.lookup([1, 2, 3, 4, 5, 6, 0]).num_tokens == 2
    table.release("a")
    table.check_integrity()


def test_pinned_pages_outlive_their_request_and_cached_ones_go_idle_on_unpin() -> None:
    """A vLLM decode still to read a vllm_blocks pool's pages keeps them past the request
    (``kv.pins``): released, they stay in use and out of the cache's reach; unpinned, the
    uncached one is free and the cached one idle (evictable), the table whole throughout."""
    pool = PagePool(6)
    pins = PagePins(pool)
    table = PageTable(pool, PS, PagePrefixCache(pool, PS), pins=pins)
    pages = table.try_reserve("a", [1, 2, 3])  # a full page (cached once committed), a partial
    assert pages is not None
    table.commit("a", 3)
    pins.pin(pages)
    assert pins.num_pinned == 2
    table.release("a")
    table.check_integrity()
    assert pool.num_free == 4 and table.cache.num_evictable == 0  # the cached page is pinned
    assert not table.cache.try_make_room(5)  # pinned pages are never evicted
    pins.unpin(pages)
    table.check_integrity()
    assert pins.num_pinned == 0 and pins.pinned() == {}
    assert pool.num_free == 5 and table.cache.num_evictable == 1
    assert table.lookup([1, 2, 3]).num_tokens == 2  # still a hit, as after any release


def test_a_page_pinned_twice_needs_two_unpins_and_an_unpinned_one_is_refused() -> None:
    pool = PagePool(4)
    pins = PagePins(pool)
    table = PageTable(pool, PS, pins=pins)
    pages = table.try_reserve("a", [1, 2])
    assert pages is not None
    pins.pin(pages)
    pins.pin(pages)
    table.release("a")
    pins.unpin(pages)
    assert pool.num_free == 3 and pins.pinned() == {pages[0]: 1}
    table.check_integrity()
    pins.unpin(pages)
    assert pool.num_free == 4
    with pytest.raises(AssertionError, match="not pinned"):
        pins.unpin(pages)
    with pytest.raises(AssertionError, match="another pool"):
        PageTable(PagePool(4), PS, pins=pins)


def test_check_integrity_counts_pins_and_catches_a_leaked_reference() -> None:
    pool = PagePool(4)
    table = PageTable(pool, PS, pins=PagePins(pool))
    pages = table.try_reserve("a", [1, 2])
    assert pages is not None
    pool.incref(pages)  # a reference nobody accounts for
    with pytest.raises(AssertionError, match="leaked"):
        table.check_integrity()


def test_pins_no_table_bound_free_to_the_pool_itself() -> None:
    """Unbound (no prefix cache over the pool: a bench's pins), an unpin frees the page."""
    pool = PagePool(4)
    pins = PagePins(pool)
    page = pool.try_alloc(1)
    assert page is not None
    pins.pin(page)
    pool.free(page)  # its owner lets go: the pin holds it
    assert pool.num_free == 3 and pins.num_pinned == 1
    pins.unpin(page)
    assert pool.num_free == 4 and pins.num_pinned == 0
    pool.check_integrity()
