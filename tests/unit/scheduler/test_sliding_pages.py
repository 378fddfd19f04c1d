"""SlidingPageTable: a sliding layer holds only its window and the chunks in flight, frees
pages once no later query sees them, never runs short inside its quota, returns every page."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import (
    NO_PAGE,
    SlidingPageTable,
    max_pages_per_request,
    sliding_pool_pages,
)

PS = 4


def test_a_chunked_prompt_keeps_only_its_window_after_each_chunk() -> None:
    pool = PagePool(64)
    table = SlidingPageTable(pool, PS, window=6, chunk_size=8)
    assert table.try_reserve("r", 30)
    first = table.pages_for("r", 0, 8)
    assert len(first) == 2 and NO_PAGE not in first
    table.chunk_done("r", 8)  # later queries see positions >= 3: page 0 still needed
    assert table.get("r")[0] != NO_PAGE
    second = table.pages_for("r", 8, 16)
    assert second[:2] == first and NO_PAGE not in second
    table.chunk_done("r", 16)  # later queries see >= 11: pages 0 and 1 ([0, 8)) freed
    assert table.get("r")[:2] == (NO_PAGE, NO_PAGE)
    table.pages_for("r", 16, 24)
    table.chunk_done("r", 24)
    table.pages_for("r", 24, 30)
    table.chunk_done("r", 30)  # the last chunk: positions [25, 30) stay, and [23, 28), the
    held = [i for i, p in enumerate(table.get("r")) if p != NO_PAGE]  # last whole page's
    assert held == [5, 6, 7] and pool.num_used == 3  # window (a kept window's): pages 5-7
    assert table.num_available_pages == 61  # the spent quota shrank to the window
    table.check_integrity()
    table.release("r")
    assert pool.num_free == 64
    table.check_integrity()


def test_admission_counts_unspent_quotas_and_refuses_without_change() -> None:
    quota = max_pages_per_request(window=6, chunk_size=8, page_size=PS)
    assert quota == -(-(5 + 16) // PS) + 1
    pool = PagePool(sliding_pool_pages(6, 8, PS, max_running_requests=2))
    table = SlidingPageTable(pool, PS, window=6, chunk_size=8)
    assert table.try_reserve("a", 100) and table.try_reserve("b", 100)
    assert pool.num_free == pool.num_pages  # nothing allocated yet, but all promised
    assert not table.try_reserve("c", 100)
    assert "c" not in table
    table.check_integrity()
    table.release("a")
    assert table.try_reserve("c", 3)  # a short prompt's quota is its pages
    table.release("b")
    table.release("c")
    assert pool.num_free == pool.num_pages and table.num_available_pages == pool.num_pages
    table.check_integrity()


def test_release_mid_prefill_returns_held_pages_and_quota() -> None:
    pool = PagePool(32)
    table = SlidingPageTable(pool, PS, window=3, chunk_size=8)
    assert table.try_reserve("r", 40)
    table.pages_for("r", 0, 8)
    table.pages_for("r", 8, 16)  # planned before the first chunk's forward was consumed
    table.release("r")  # aborted with both in flight
    assert pool.num_free == 32 and table.num_available_pages == 32
    table.check_integrity()


@pytest.mark.parametrize(("page_size", "window", "chunk_size"), [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_a_size_of_0_is_refused(page_size: int, window: int, chunk_size: int) -> None:
    with pytest.raises(AssertionError):
        SlidingPageTable(PagePool(64), page_size, window, chunk_size)


def test_page_size_1_holds_exactly_the_window() -> None:
    pool = PagePool(16)
    table = SlidingPageTable(pool, 1, window=3, chunk_size=2)
    assert table.try_reserve("r", 8)
    assert NO_PAGE not in table.pages_for("r", 0, 2)
    table.chunk_done("r", 2)  # later queries see positions >= 0: nothing freed
    assert NO_PAGE not in table.get("r")
    entries = table.pages_for("r", 2, 4)
    assert NO_PAGE not in entries and len(entries) == 4
    table.chunk_done("r", 4)  # later queries see >= 2
    assert [p == NO_PAGE for p in table.get("r")] == [True, True, False, False]
    table.release("r")
    table.check_integrity()


def test_integrity_names_a_leaked_sliding_page() -> None:
    pool = PagePool(16)
    table = SlidingPageTable(pool, PS, window=3, chunk_size=4)
    pool.try_alloc(1)
    with pytest.raises(AssertionError, match=r"^a sliding page leaked$"):
        table.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, PS]),
    window=st.integers(1, 20),
    chunk=st.integers(1, 3),
    prompts=st.lists(st.integers(1, 60), min_size=1, max_size=4),
)
def test_overlapped_chunks_always_find_their_window(
    page_size: int, window: int, chunk: int, prompts: list[int]
) -> None:
    """Requests advance one chunk per step, the next chunk planned before the previous one is
    consumed (overlapped forwards): every chunk finds ``[start - window + 1, end)`` held."""
    chunk *= page_size
    pool = PagePool(sliding_pool_pages(window, chunk, page_size, len(prompts)))
    table = SlidingPageTable(pool, page_size, window, chunk)
    in_flight: dict[str, int] = {}  # request -> end of its chunk in the forward
    written: dict[str, tuple[int, ...]] = {}  # request -> its entries as its last chunk wrote
    progress = {f"r{i}": 0 for i in range(len(prompts))}
    lengths = {f"r{i}": n for i, n in enumerate(prompts)}
    for rid, n in lengths.items():
        assert table.try_reserve(rid, n)
    while progress:
        planned = {}
        for rid, start in progress.items():
            end = min(start + chunk, lengths[rid])
            entries = table.pages_for(rid, start, end)
            for pos in range(max(0, start - window + 1), end):
                assert entries[pos // page_size] != NO_PAGE, (rid, pos)
            for pos in range(max(0, start - window + 1), start):  # the same page as written
                assert entries[pos // page_size] == written[rid][pos // page_size], (rid, pos)
            written[rid] = entries
            planned[rid] = end
        for rid, end in in_flight.items():  # the previous forward is consumed
            table.chunk_done(rid, end)
        table.check_integrity()
        in_flight, progress = planned, {r: e for r, e in planned.items() if e < lengths[r]}
    for rid, end in in_flight.items():
        table.chunk_done(rid, end)
        tail = [i for i, p in enumerate(table.get(rid)) if p != NO_PAGE]
        whole = end // page_size * page_size  # the last whole page's end: its window too
        assert tail == list(range(max(0, whole - window + 1) // page_size, -(-end // page_size)))
    for rid in lengths:
        table.release(rid)
    assert pool.num_free == pool.num_pages
    table.check_integrity()


def test_window_first_is_the_page_of_the_first_position_a_prefix_end_needs() -> None:
    table = SlidingPageTable(PagePool(64), PS, window=6, chunk_size=8)
    assert [table.window_first(n) for n in range(5)] == [0, 0, 0, 1, 2]  # (4n - 5) // 4
    exact = SlidingPageTable(PagePool(16), 1, window=3, chunk_size=2)
    assert [exact.window_first(n) for n in range(4)] == [0, 0, 0, 1]


def test_a_whole_page_prompt_keeps_its_window_and_a_one_page_hit_uses_one() -> None:
    pool = PagePool(64)
    table = SlidingPageTable(pool, PS, window=6, chunk_size=8)
    assert table.try_reserve("r", 16)
    for start in (0, 8):
        table.pages_for("r", start, start + 8)
        table.chunk_done("r", start + 8)
    assert table.keep_window("r", 7, 4)  # entries end exactly at the chain's end
    assert not table.keep_window("r", 5, 1)  # page 0: not held any more
    table.release("r")
    assert table.window_keys() == (7,) and pool.num_used == 2  # [11, 16): pages 2 and 3
    table.forget_windows([7])
    assert pool.num_free == 64
    assert table.try_reserve("s", 5)
    table.pages_for("s", 0, 5)
    table.chunk_done("s", 5)
    assert table.keep_window("s", 11, 1)  # a one-page chain: [0, 4)
    table.release("s")
    assert table.usable_pages([11]) == 1 and table.usable_pages([3, 11]) == 2
    assert table.usable_pages([11, 3]) == 1 and table.usable_pages([3]) == 0
    assert table.try_reserve("t", 9, 11, 1)
    assert table.get("t") == table.get("t")[:1] and pool.num_used == 1
    table.release("t")
    table.check_integrity()


def test_room_for_a_reservation_evicts_exactly_enough_and_never_the_hit() -> None:
    window, chunk = 6, 4
    table = SlidingPageTable(PagePool(12), PS, window, chunk)  # quota 5: (5 + 8) / 4 + 1
    for key, tokens in ((1, 8), (2, 8), (3, 8)):  # windows of 2 pages ([3, 8))
        assert table.try_reserve(f"r{key}", tokens)
        table.pages_for(f"r{key}", 0, 4)
        table.chunk_done(f"r{key}", 4)
        table.pages_for(f"r{key}", 4, 8)
        table.chunk_done(f"r{key}", 8)
        assert table.keep_window(f"r{key}", key, 2)
        table.release(f"r{key}")
    assert table.num_available_pages == 6 and table.window_keys() == (1, 2, 3)
    assert table.try_reserve("a", 100)  # 5 of 6: nothing evicted
    assert table.window_keys() == (1, 2, 3) and table.num_available_pages == 1
    assert table.try_reserve("b", 8, 1, 2)  # quota 2, 1 short: 2's window goes, not 1's
    assert table.window_keys() == (3, 1) and table.get("b") == table.get("b")[:2]
    assert not table.try_reserve("c", 16)  # quota 4, 3 short: 3's window frees 2, 1's none (b's)
    assert table.window_keys() == (3, 1)
    table.check_integrity()
    table.release("a")
    table.release("b")
    table.forget_windows([1, 3])
    assert table.pool.num_free == 12
    table.check_integrity()
