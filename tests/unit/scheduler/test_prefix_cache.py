"""The prefix cache and the page table over it: hashes, hits, sharing, eviction, the cap,
collisions and the KV events it reports. Plain ints, no engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prefill_worker.kv.block_hash import block_hash, block_hashes, pack_block
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.prefix_cache import NoPrefixCache
from prefill_worker.kv.tables import PageTable
from tests.unit.scheduler.fakes import RecordingEvents

PS = 4


def rig(
    num_pages: int = 16, max_pages: int | None = None, hasher=block_hash
) -> tuple[PageTable, PagePrefixCache, RecordingEvents]:
    pool, events = PagePool(num_pages), RecordingEvents()
    cache = PagePrefixCache(pool, PS, max_pages, events, hasher)
    return PageTable(pool, PS, cache), cache, events


def serve(table: PageTable, request_id: str, tokens: list[int]) -> tuple[int, ...]:
    """Admit, compute (every full page enters the cache) and keep the pages; the hit's pages."""
    hit = table.lookup(tokens)
    page_ids = table.try_reserve(request_id, tokens, hit)
    assert page_ids is not None
    table.commit(request_id, len(tokens))
    table.check_integrity()
    return hit.page_ids


def test_block_hashes_are_pinned_and_do_not_depend_on_the_process() -> None:
    # These numbers are part of the KV-event contract: routers index them across restarts.
    assert block_hashes(list(range(1, 10)), 4) == [4670338343387946162, 17106590222795520939]
    assert block_hash(None, pack_block([1, 2, 3, 4], 0, 4)) == 4670338343387946162
    code = "from prefill_worker.kv.block_hash import block_hashes; print(block_hashes([7]*8, 4))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert runs == {f"{block_hashes([7] * 8, 4)}\n"}


def test_a_hit_is_the_longest_cached_prefix_of_whole_pages_minus_the_last_token() -> None:
    table, cache, _ = rig()
    a = list(range(100, 114))  # 14 tokens: 3 full pages and a partial one
    serve(table, "a", a)
    assert cache.num_pages == 3
    assert table.lookup(a).num_tokens == 12  # all full pages; tokens 12, 13 are computed
    assert table.lookup(a[:12]).num_tokens == 8  # whole prompt cached: the last page recomputed
    assert table.lookup(a[:13]).num_tokens == 12
    assert table.lookup([*a[:5], 0, *a[6:]]).num_tokens == 4  # block 1 differs
    assert table.lookup([0, *a[1:]]).num_tokens == 0
    assert table.lookup(a[:4]).num_tokens == 0 and table.lookup(a[:1]).num_tokens == 0
    hit = table.lookup(a)
    assert hit.page_ids == table.get("a")[:3] and hit.num_query_tokens == 14
    assert hit.block_hashes == tuple(block_hashes(a, PS))
    # A cap (prompt logprobs from a position): whole pages up to it, the query still whole.
    for cap, num_hit in ((0, 0), (3, 0), (4, 4), (9, 8), (12, 12), (13, 12), (100, 12)):
        capped = table.lookup(a, max_hit_tokens=cap)
        assert (capped.num_tokens, capped.num_query_tokens) == (num_hit, 14), cap
        assert capped.page_ids == hit.page_ids[: num_hit // PS]
        assert capped.block_hashes == hit.block_hashes[: num_hit // PS]


def test_shared_pages_are_counted_and_go_idle_only_when_nobody_uses_them() -> None:
    table, cache, _ = rig()
    a, b = list(range(14)), [*range(12), 50, 51, 52, 53]
    serve(table, "a", a)
    shared = serve(table, "b", b)
    assert shared == table.get("a")[:3] == table.get("b")[:3]
    assert [table.pool.refcount(p) for p in shared] == [3, 3, 3]  # a, b and the cache
    table.release("a")
    assert cache.num_evictable == 0  # b still uses them
    table.release("b")
    assert cache.num_evictable == cache.num_pages == 4  # b's fourth page was stored too
    assert table.num_available_pages == table.pool.num_pages
    table.check_integrity()


def test_eviction_takes_idle_pages_oldest_first_tail_first_and_only_when_needed() -> None:
    table, cache, events = rig(num_pages=8)
    serve(table, "a", list(range(8)))  # pages 0, 1
    serve(table, "b", list(range(50, 58)))  # pages 2, 3
    table.release("a")
    table.release("b")
    assert table.pool.num_free == 4 and cache.num_evictable == 4
    serve(table, "c", list(range(90, 106)))  # 4 pages: all free ones, nothing evicted
    assert not [e for e in events.events if e[0] == "removed"]
    assert table.try_reserve("d", list(range(200, 212))) is not None  # 3 pages: evicts 3
    removed = [h for e in events.events if e[0] == "removed" for h in e[1]]
    a_hashes, b_hashes = block_hashes(list(range(8)), PS), block_hashes(list(range(50, 58)), PS)
    assert removed == [a_hashes[1], a_hashes[0], b_hashes[1]]  # a went idle first; tail first
    assert table.lookup(list(range(50, 59))).num_tokens == 4  # b's first page survived
    table.check_integrity()


def test_admission_that_cannot_fit_evicts_nothing() -> None:
    table, cache, events = rig(num_pages=6)
    serve(table, "a", list(range(8)))
    table.release("a")  # two idle pages
    serve(table, "b", list(range(50, 66)))  # four pages in use
    assert table.try_reserve("c", list(range(200, 212))) is None  # 3 pages; 2 could be evicted
    assert cache.num_evictable == 2 and not [e for e in events.events if e[0] == "removed"]


def test_a_hit_page_is_not_evicted_for_the_request_that_hit_it() -> None:
    table, cache, _ = rig(num_pages=4)
    a = list(range(8))
    serve(table, "a", a)
    table.release("a")  # pages 0, 1 idle; 2, 3 free
    b = [*a, *range(20, 27)]  # 15 tokens: 4 pages, 2 of them a hit
    hit = table.lookup(b)
    assert hit.num_tokens == 8
    page_ids = table.try_reserve("b", b, hit)
    assert page_ids is not None and page_ids[:2] == hit.page_ids
    assert cache.num_evictable == 0
    c = list(range(300, 304))
    assert table.try_reserve("c", c) is None  # nothing idle, nothing free: wait
    table.check_integrity()


def test_the_cap_bounds_the_cache_and_evicts_idle_pages_to_stay_under_it() -> None:
    table, cache, _ = rig(num_pages=16, max_pages=3)
    serve(table, "a", list(range(20)))  # 5 full pages, only 3 cached
    assert cache.num_pages == 3 and table.lookup(list(range(21))).num_tokens == 12
    table.release("a")
    serve(table, "b", list(range(100, 108)))  # 2 more: the 2 oldest idle ones make room
    assert cache.num_pages == 3
    assert table.lookup(list(range(100, 109))).num_tokens == 8
    table.check_integrity()


def test_a_page_is_cached_once_the_first_complete_copy_wins() -> None:
    table, cache, events = rig()
    a = list(range(16))
    for request_id in ("a", "b"):  # both admitted before either computed: both miss
        assert table.try_reserve(request_id, a, table.lookup(a)) is not None
    table.commit("a", 8)  # a's first two pages are complete
    table.commit("b", 16)  # b's four: its first two duplicate a's, the last two are new
    table.commit("a", 16)  # a's last two are duplicates now
    assert cache.num_pages == 4
    hashes = block_hashes(a, PS)
    stored = [e for e in events.events if e[0] == "stored"]
    assert [(e[1], e[2]) for e in stored] == [
        (tuple(hashes[:2]), None),
        (tuple(hashes[2:]), hashes[1]),
    ]
    assert stored[1][3] == tuple(a[8:])
    assert set(cache.cached_page_ids()) == {*table.get("a")[:2], *table.get("b")[2:]}
    table.release("a")
    table.release("b")
    table.check_integrity()


def test_collisions_never_hit_the_wrong_tokens() -> None:
    table, cache, _ = rig(hasher=lambda parent, packed: 7)  # every block collides
    a, b = list(range(12)), list(range(50, 62))
    serve(table, "a", a)
    assert cache.num_pages == 1  # a's second block collides with its first: the chain stops
    assert table.lookup(b).num_tokens == 0  # b's first block collides with a's: not a hit
    serve(table, "b", b)
    assert cache.num_pages == 1 and table.lookup(a).num_tokens == 4


def test_a_chain_whose_parent_was_evicted_stops() -> None:
    """x computed its own copy of blocks 0-1 (a stored theirs first); a's copies go idle and
    are evicted; x's block 2 would then hang below an unknown parent: it is not stored."""
    table, cache, events = rig(num_pages=10)
    a = list(range(16))
    for request_id in ("a", "x"):
        assert table.try_reserve(request_id, a, table.lookup(a)) is not None
    table.commit("a", 8)
    table.commit("x", 8)  # duplicates: x's chain follows a's pages
    table.release("a")  # a's blocks 0-1 idle; its pages 2-3 (never stored) free
    assert table.try_reserve("d", list(range(100, 124))) is not None  # 6 pages: evicts 2
    assert cache.num_pages == 0
    table.commit("x", 16)
    assert cache.num_pages == 0 and table.lookup(a).num_tokens == 0
    assert [e[0] for e in events.events] == ["stored", "removed"]
    table.check_integrity()


def test_reset_clears_an_idle_cache_and_says_so() -> None:
    table, cache, events = rig()
    serve(table, "a", list(range(8)))
    assert not cache.reset()  # a still uses its pages
    table.release("a")
    assert cache.reset() and cache.num_pages == 0 and events.events[-1] == ("cleared",)
    assert table.pool.num_free == table.pool.num_pages
    table.check_integrity()


def test_no_prefix_cache_keeps_nothing() -> None:
    pool = PagePool(4)
    table = PageTable(pool, PS, NoPrefixCache(pool))
    serve(table, "a", list(range(8)))
    assert table.lookup(list(range(9))).num_tokens == 0 == table.lookup([1]).num_query_tokens
    table.release("a")
    assert pool.num_free == 4 and table.num_available_pages == 4


@pytest.mark.parametrize("max_pages", [0, 1])
def test_tiny_caps(max_pages: int) -> None:
    table, cache, _ = rig(max_pages=max_pages)
    serve(table, "a", list(range(12)))
    assert cache.num_pages == max_pages
    table.release("a")
    table.check_integrity()


def test_at_the_cap_a_stored_run_is_reported_before_its_parent_is_evicted() -> None:
    """x follows a's cached blocks 0-1 (its own copies are duplicates), stores block 2, and
    needs room for block 3: the idle block 1 goes. The consumer heard of block 2 while its
    parent was still there (the recorder checks every parent is known)."""
    table, cache, events = rig(max_pages=3)
    p = list(range(8))
    x = [*p, *range(40, 48)]
    assert table.try_reserve("a", p) is not None and table.try_reserve("x", x) is not None
    table.commit("a", 8)
    table.release("a")  # blocks 0-1 idle, block 1 the oldest
    table.commit("x", 16)
    h = block_hashes(x, PS)
    assert [e[:3] for e in events.events] == [
        ("stored", (h[0], h[1]), None),
        ("stored", (h[2],), h[1]),
        ("removed", (h[1],)),
        ("stored", (h[3],), h[2]),
    ]
    assert cache.num_pages == 3
    table.check_integrity()
