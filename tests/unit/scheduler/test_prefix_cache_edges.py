"""The prefix cache's rarer paths, each with the KV events a router sees: a block whose parent
was evicted while a request still used it, stores in chunks, resets, bad settings (found
unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import pytest

from prefill_worker.kv.block_hash import block_hashes
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.prefix_cache import MISS, NoPrefixCache
from tests.unit.scheduler.fakes import RecordingEvents

PS = 2


def cache_with_events(num_pages: int = 8) -> tuple[PagePool, PagePrefixCache, RecordingEvents]:
    pool, events = PagePool(num_pages), RecordingEvents()
    return pool, PagePrefixCache(pool, PS, events=events), events


def test_settings_that_cannot_work_are_refused() -> None:
    pool = PagePool(4)
    with pytest.raises(AssertionError):
        PagePrefixCache(pool, 0)
    with pytest.raises(AssertionError):
        PagePrefixCache(pool, PS, max_pages=-1)


def test_a_block_orphaned_by_an_evicted_parent_is_rejoined_when_the_prefix_returns() -> None:
    """Two requests compute [1, 2 | 3, 4] at once; the first caches block 0, the second block 1
    (block 0's content is cached already: its own page stays its own). Block 0 goes idle and is
    evicted while block 1 is in use. When [1, 2, 3, 4] comes again, its block 0 is cached anew
    and found to be block 1's parent: block 1 is shared, and the router is told of block 0."""
    pool, cache, events = cache_with_events()
    prompt = [1, 2, 3, 4, 9]
    h0, h1 = block_hashes(prompt, PS)
    first, second = pool.try_alloc(1), pool.try_alloc(2)
    assert first is not None and second is not None
    assert cache.store(prompt, first, (), 1) == (h0,)
    assert cache.store(prompt, second, (), 2) == (h0, h1)  # block 0: the first one's page
    cache.release(first)  # block 0 idle, block 1 still the second request's
    assert cache.try_make_room(pool.num_free + 1) and cache.num_pages == 1
    cache.release(second)
    third = pool.try_alloc(2)
    assert third is not None and cache.match(prompt).page_ids == ()
    events.events.clear()
    assert cache.store(prompt, third, (), 2) == (h0, h1)
    assert events.events == [("stored", (h0,), None, (1, 2))]
    assert cache.match(prompt).page_ids == (third[0], second[1])


def test_a_prompt_stored_in_chunks_names_each_chunks_parent() -> None:
    pool, cache, events = cache_with_events()
    prompt = [1, 2, 3, 4, 5, 6, 9]
    h0, h1, h2 = block_hashes(prompt, PS)
    pages = pool.try_alloc(4)
    assert pages is not None
    chain = cache.store(prompt, pages, (), 1)
    chain = cache.store(prompt, pages, chain, 3)
    assert chain == (h0, h1, h2)
    assert events.events == [
        ("stored", (h0,), None, (1, 2)),
        ("stored", (h1, h2), h0, (3, 4, 5, 6)),
    ]


def test_resetting_an_idle_cache_is_one_clear_and_a_busy_one_says_nothing() -> None:
    pool, cache, events = cache_with_events()
    prompt = [1, 2, 3, 4, 9]
    pages = pool.try_alloc(2)
    assert pages is not None
    cache.store(prompt, pages, (), 2)
    events.events.clear()
    assert not cache.reset()  # every cached page is in use: nothing to evict, nothing to say
    assert events.events == []
    cache.release(pages)
    assert cache.reset()
    assert events.events == [("cleared",)]
    assert pool.num_free == pool.num_pages


def test_with_the_cache_off_nothing_is_shared_or_kept() -> None:
    pool = PagePool(4)
    off = NoPrefixCache(pool)
    pages = pool.try_alloc(3)
    assert pages is not None
    assert off.match([1, 2, 3, 4, 5]) == MISS and MISS.num_query_tokens == 0
    assert off.store([1, 2, 3, 4, 5], pages, (), 2) == ()
    assert (off.num_pages, off.num_evictable, tuple(off.cached_page_ids())) == (0, 0, ())
    assert tuple(off.cached_hashes()) == ()
    off.watch(lambda hashes: pytest.fail("nothing is ever evicted"))
    assert off.try_make_room(1) and not off.try_make_room(2)  # exactly the free pages
    with pytest.raises(AssertionError, match=r"^nothing is cached$"):
        off.acquire(pages[:1])
    off.release(pages)
    assert pool.num_free == 4 and off.reset()
    off.check_integrity()


def test_watchers_hear_every_eviction_and_the_cached_hashes_follow() -> None:
    """A windowed sliding pool drops a kept window with its block (``kv.sliding``): every
    eviction, at the cap, for room, and by a reset, names the blocks it dropped."""
    pool = PagePool(6)
    cache = PagePrefixCache(pool, PS, max_pages=3)
    heard: list[list[int]] = []
    cache.watch(lambda hashes: heard.append(list(hashes)))
    cache.watch(lambda hashes: heard.append(["again", *hashes]))
    prompt, other = [1, 2, 3, 4, 5, 6, 7], [9, 9, 9]
    h0, h1, h2 = block_hashes(prompt, PS)
    (g0,) = block_hashes(other, PS)
    pages, others = pool.try_alloc(3), pool.try_alloc(1)
    assert pages is not None and others is not None
    assert cache.store(prompt, pages, (), 3) == (h0, h1, h2)
    assert set(cache.cached_hashes()) == {h0, h1, h2}
    cache.release(pages)
    assert heard == []
    assert cache.store(other, others, (), 1) == (g0,)  # at the cap: one idle page goes
    assert heard == [[h2], ["again", h2]]  # the prompt's last page first
    assert set(cache.cached_hashes()) == {h0, h1, g0}
    heard.clear()
    assert cache.try_make_room(pool.num_free + 1)
    assert heard == [[h1], ["again", h1]]
    heard.clear()
    cache.release(others)
    assert cache.reset()
    assert sorted(heard[0]) == sorted([h0, g0]) and len(heard) == 2
    assert tuple(cache.cached_hashes()) == ()


@pytest.mark.parametrize(("length", "num_hashes"), [(1, 0), (2, 1), (3, 1), (4, 2), (7, 3)])
def test_only_full_blocks_have_hashes(length: int, num_hashes: int) -> None:
    assert len(block_hashes(list(range(length)), PS)) == num_hashes
