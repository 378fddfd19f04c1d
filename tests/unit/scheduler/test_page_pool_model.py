"""The page pool against a set model: a dict of page -> owners beside it, under random
allocations, shared references and frees. Every allocation takes free pages only, with
refcount 1, in as few runs as the pool allows (one whole run, the smallest that fits, when
any fits); no-space is None and changes nothing; counts and runs always agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_worker.kv.pages import PagePool


def free_runs(owners: dict[int, int], num_pages: int) -> list[tuple[int, int]]:
    """Maximal runs of free pages as (start, length), from the model alone."""
    runs: list[tuple[int, int]] = []
    for page_id in range(num_pages):
        if owners.get(page_id, 0):
            continue
        if runs and sum(runs[-1]) == page_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page_id, 1))
    return runs


def expected_alloc(owners: dict[int, int], num_pages: int, n: int) -> list[int] | None:
    """Best fit: the smallest free run that holds ``n`` whole (lowest start among equals);
    else the largest runs stitched, largest (then lowest) first."""
    runs = free_runs(owners, num_pages)
    if n > sum(length for _, length in runs):
        return None
    fits = [(length, start) for start, length in runs if length >= n]
    if fits:
        _, start = min(fits)
        return list(range(start, start + n))
    taken: list[int] = []
    for start, length in sorted(runs, key=lambda r: (-r[1], r[0])):
        take = min(length, n - len(taken))
        taken += range(start, start + take)
        if len(taken) == n:
            break
    return taken


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "share", "free"]), st.integers(0, 12), st.integers(0, 99)),
    max_size=50,
)


@settings(max_examples=300)
@given(num_pages=st.integers(1, 24), ops=OPS)
def test_the_pool_matches_its_set_model(num_pages: int, ops: list[tuple[str, int, int]]) -> None:
    pool, owners = PagePool(num_pages), {}  # owners: page -> references held
    held: list[int] = []  # one entry per reference the test holds
    for op, n, pick in ops:
        if op == "alloc":
            want = expected_alloc(owners, num_pages, n)
            got = pool.try_alloc(n)
            assert (got if got is None else sorted(got)) == (want if want is None else sorted(want))
            if got is None:
                continue
            assert all(owners.get(p, 0) == 0 for p in got) and len(set(got)) == n
            if (
                n
                and len(free_runs(owners, num_pages))
                and max(length for _, length in free_runs(owners, num_pages)) >= n
            ):
                assert got == list(range(got[0], got[0] + n))  # one whole run
            for p in got:
                owners[p] = 1
            held += got
        elif op == "share" and held:
            page_id = held[pick % len(held)]
            pool.incref([page_id])
            owners[page_id] += 1
            held.append(page_id)
        elif op == "free" and held:
            batch = sorted({held[(pick + i) % len(held)] for i in range(min(n, len(held)))})
            pool.free(batch)
            for page_id in batch:
                owners[page_id] -= 1
                held.remove(page_id)
        for page_id in range(num_pages):
            assert pool.refcount(page_id) == owners.get(page_id, 0)
        assert pool.num_free == sum(1 for p in range(num_pages) if not owners.get(p, 0))
        assert pool.num_used == num_pages - pool.num_free
        assert pool.num_free_runs == len(free_runs(owners, num_pages))
        pool.check_integrity()


def test_a_pool_needs_a_page_and_a_free_page_cannot_be_shared() -> None:
    with pytest.raises(AssertionError):
        PagePool(0)
    pool = PagePool(2)
    pool.try_alloc(1)
    with pytest.raises(AssertionError, match=r"^page 1 is free$"):
        pool.incref([1])
    assert pool.refcount(1) == 0
