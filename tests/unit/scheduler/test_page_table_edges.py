"""The page table's rarer paths (found unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import pytest

from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
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
