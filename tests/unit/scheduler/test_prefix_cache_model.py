"""The prefix cache against a naive reference: a dict of full token prefixes.

A page's K/V depends on every token before it, not only on its own block: the reference
records, for each page a request computed, the whole prompt prefix up to that page's end, and
forgets it when the pool frees the page. Then every lookup must hit only pages computed under
exactly the prompt's own prefix (never a wrong-KV hit), and, with a hasher that does not
collide, hit every page the reference says is cached. Random stores, lookups, evictions and
resets, with a deliberately weak hasher (given through ``PagePrefixCache``'s ``hasher``) whose
blocks and parents collide all the time.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefill_worker.kv.block_hash import block_hash
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.tables import num_pages_for


def weak_hash(parent: int | None, packed: bytes) -> int:
    """Two bits. Blocks with the same token sum collide ([0, 2] and [1, 1]), and so do
    parents of the same parity: a lookup must compare tokens and parents."""
    return (sum(packed) + (parent or 0) % 2) % 4


class PrefixModel(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2]),
        num_pages=st.integers(2, 16),
        max_pages=st.one_of(st.none(), st.integers(0, 8)),
        is_weak=st.booleans(),
    )
    def setup(self, page_size: int, num_pages: int, max_pages: int | None, is_weak: bool) -> None:
        self.ps, self.is_weak = page_size, is_weak
        self.pool = PagePool(num_pages)
        hasher = weak_hash if is_weak else block_hash
        self.cache = PagePrefixCache(self.pool, page_size, max_pages, hasher=hasher)
        self.computed_under: dict[int, tuple[int, ...]] = {}  # page -> the prefix it ends
        self.live: list[tuple[int, ...]] = []  # the page ids of requests still running
        self.blocks: list[list[int]] = []  # every full block a request brought, for splicing

    def reference(self) -> dict[tuple[int, ...], int]:
        """Full token prefix -> the cached page holding its last block."""
        return {self.computed_under[p]: p for p in self.cache.cached_page_ids()}

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10),
        max_hit=st.one_of(st.none(), st.integers(0, 10)),
    )
    def lookup(self, tokens: list[int], max_hit: int | None) -> None:
        self._check_hit(tokens, max_hit)

    @precondition(lambda self: bool(self.blocks))
    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=4), last=st.integers(0, 2))
    def lookup_spliced(self, picks: list[int], last: int) -> None:
        """Blocks of earlier prompts in another order: where collisions and shared blocks
        meet other contexts."""
        self._check_hit(self._spliced(picks, last), None)

    @precondition(lambda self: bool(self.blocks))
    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=4), last=st.integers(0, 2))
    def run_spliced(self, picks: list[int], last: int) -> None:
        self.run_request(self._spliced(picks, last))

    def _check_hit(self, tokens: list[int], max_hit: int | None) -> None:
        hit = self.cache.match(tokens, max_hit)
        for i, page_id in enumerate(hit.page_ids):
            assert self.computed_under[page_id] == tuple(tokens[: (i + 1) * self.ps]), page_id
        limit = len(tokens) - 1 if max_hit is None else min(len(tokens) - 1, max_hit)
        assert hit.num_tokens == len(hit.page_ids) * self.ps <= limit
        if not self.is_weak:  # no collision: every cached page of the prefix is hit
            assert hit.page_ids == self._expected(tokens, limit)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def run_request(self, tokens: list[int]) -> None:
        """Admit (hit, reserve), compute the rest, store its full pages; it stays live."""
        self.blocks += [
            tokens[i : i + self.ps] for i in range(0, len(tokens) - self.ps + 1, self.ps)
        ]
        hit = self.cache.match(tokens)
        need = num_pages_for(len(tokens), self.ps) - len(hit.page_ids)
        self.cache.acquire(hit.page_ids)
        fresh = self.pool.try_alloc(need) if self.cache.try_make_room(need) else None
        if fresh is None:
            self.cache.release(hit.page_ids)
            self._forget_freed()
            return
        page_ids = (*hit.page_ids, *fresh)
        for i in range(len(hit.page_ids), len(page_ids)):
            self.computed_under[page_ids[i]] = tuple(tokens[: (i + 1) * self.ps])
        self.cache.store(tokens, page_ids, hit.block_hashes, len(tokens) // self.ps)
        self._forget_freed()
        self.live.append(page_ids)

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        self.cache.release(self.live.pop(index % len(self.live)))
        self._forget_freed()

    @rule(num_pages=st.integers(0, 16))
    def evict(self, num_pages: int) -> None:
        could = num_pages - self.pool.num_free <= self.cache.num_evictable
        assert self.cache.try_make_room(num_pages) == could
        self._forget_freed()

    @rule()
    def reset(self) -> None:
        is_all_idle = self.cache.num_evictable == self.cache.num_pages
        assert self.cache.reset() == is_all_idle
        self._forget_freed()

    @invariant()
    def the_pool_and_cache_agree(self) -> None:
        self.cache.check_integrity()
        self.pool.check_integrity()

    def teardown(self) -> None:
        while self.live:
            self.finish(0)
        assert self.cache.reset() and self.pool.num_free == self.pool.num_pages

    def _expected(self, tokens: list[int], limit: int) -> tuple[int, ...]:
        cached, pages = self.reference(), []
        for end in range(self.ps, limit + 1, self.ps):
            page_id = cached.get(tuple(tokens[:end]))
            if page_id is None:
                break
            pages.append(page_id)
        return tuple(pages)

    def _spliced(self, picks: list[int], last: int) -> list[int]:
        return [t for i in picks for t in self.blocks[i % len(self.blocks)]] + [last]

    def _forget_freed(self) -> None:
        for page_id in [p for p in self.computed_under if self.pool.refcount(p) == 0]:
            del self.computed_under[page_id]


PrefixModel.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_the_prefix_cache_matches_its_reference = PrefixModel.TestCase


def test_a_collision_in_a_first_block_stops_the_chain_so_no_page_is_hit_out_of_context() -> None:
    """[0, 2] and [1, 1] collide under the weak hasher. The prompt [1, 1, 2, 2] finds [0, 2]
    cached under its first block's hash: its chain must stop there; were it cached on top,
    [0, 2, 2, 2] would hit the page computed after [1, 1]."""
    pool = PagePool(8)
    cache = PagePrefixCache(pool, 2, hasher=weak_hash)
    first = pool.try_alloc(2)
    assert first is not None
    assert len(cache.store([0, 2, 5, 6], first, (), 2)) == 2
    second = pool.try_alloc(2)
    assert second is not None
    assert cache.store([1, 1, 2, 2], second, (), 2) == ()  # its first block collides
    hit = cache.match([0, 2, 2, 2, 9])
    assert hit.page_ids == (first[0],)  # [0, 2] only: [2, 2] was computed after [1, 1]
