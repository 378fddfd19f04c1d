"""A state machine over the page table and its prefix cache: admit (with hits), compute,
finish, abort (also while a forward holds the pages), evict, reset, pool exhaustion.

The model writes every computed token into its page and forgets what a page held once the
pool frees it. So a hit on a page with other tokens, on a page freed and reused, or on a page
that is not complete yet reads wrong tokens; and a write into a page someone else shares is
caught when it happens. After every step: each page's refcount is exactly its holders
(requests, pages a forward still holds, the cache), no page left the cache while a request
used it, and the KV events describe what is cached. Prompts come from a 3-token alphabet so
that they share prefixes often; one hasher in three collides on purpose.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from prefill_worker.kv.block_hash import block_hash
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.tables import PageTable, num_pages_for
from tests.unit.scheduler.fakes import RecordingEvents


def weak_hash(parent: int | None, packed: bytes) -> int:
    """Three bits: distinct blocks collide all the time."""
    return zlib.crc32(packed, 0 if parent is None else parent + 1) & 7


@dataclass
class Held:
    request_id: str
    tokens: list[int]
    page_ids: tuple[int, ...]
    num_computed: int


class PrefixCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(3, 24),
        max_pages=st.one_of(st.none(), st.integers(0, 12)),
        weak=st.sampled_from([False, False, True]),
    )
    def setup(self, page_size: int, num_pages: int, max_pages: int | None, weak: bool) -> None:
        self.ps = page_size
        self.pool = PagePool(num_pages)
        self.events = RecordingEvents()
        hasher = weak_hash if weak else block_hash
        self.cache = PagePrefixCache(self.pool, page_size, max_pages, self.events, hasher)
        self.table = PageTable(self.pool, page_size, self.cache)
        self.content: dict[int, list[int | None]] = {}  # page -> the tokens written into it
        self.live: dict[str, Held] = {}
        self.in_forward: list[tuple[int, ...]] = []  # pages of aborted requests a forward holds
        self.num_admitted = 0

    # ---- rules --------------------------------------------------------------------------

    @rule(target=requests, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=24))
    def admit(self, tokens: list[int]) -> str:
        request_id = f"r{self.num_admitted}"
        self.num_admitted += 1
        hit = self.table.lookup(tokens)
        assert hit.num_tokens % self.ps == 0 and hit.num_tokens < len(tokens)
        assert hit.num_query_tokens == len(tokens)
        for i, page_id in enumerate(hit.page_ids):  # a hit reads exactly the prompt's tokens
            assert self.content[page_id] == tokens[i * self.ps : (i + 1) * self.ps], page_id
        need = num_pages_for(len(tokens), self.ps) - len(hit.page_ids)
        idle_hits = sum(1 for p in hit.page_ids if self.pool.refcount(p) == 1)  # not for it
        could = self.pool.num_free + self.cache.num_evictable - idle_hits >= need
        page_ids = self._evicting(lambda: self.table.try_reserve(request_id, tokens, hit))
        assert (page_ids is not None) == could  # exhaustion only when even eviction won't do
        if page_ids is not None:
            self.live[request_id] = Held(request_id, tokens, page_ids, hit.num_tokens)
        return request_id

    @rule(request_id=requests, num_pages=st.integers(1, 3))
    def compute(self, request_id: str, num_pages: int) -> None:
        held = self.live.get(request_id)
        if held is None or held.num_computed == len(held.tokens):
            return
        end = min(len(held.tokens), (held.num_computed // self.ps + num_pages) * self.ps)
        for pos in range(held.num_computed, end):
            page_id = held.page_ids[pos // self.ps]
            assert self.pool.refcount(page_id) == 1, f"write into shared page {page_id}"
            self.content.setdefault(page_id, [None] * self.ps)[pos % self.ps] = held.tokens[pos]
        held.num_computed = end
        self._evicting(lambda: self.table.commit(request_id, end))

    @rule(request_id=consumes(requests))
    def finish(self, request_id: str) -> None:
        if request_id in self.live:
            del self.live[request_id]
            self._freeing(lambda: self.table.release(request_id))

    @rule(request_id=consumes(requests), is_in_forward=st.booleans())
    def abort(self, request_id: str, is_in_forward: bool) -> None:
        if request_id not in self.live:
            return
        del self.live[request_id]
        if is_in_forward:
            self.in_forward.append(self.table.detach(request_id))
        else:
            self._freeing(lambda: self.table.release(request_id))

    @precondition(lambda self: bool(self.in_forward))
    @rule()
    def collect(self) -> None:
        for page_ids in self.in_forward:
            self._freeing(lambda page_ids=page_ids: self.table.free_detached(page_ids))
        self.in_forward.clear()

    @rule(num_pages=st.integers(0, 24))
    def evict(self, num_pages: int) -> None:
        short = num_pages - self.pool.num_free
        could = short <= self.cache.num_evictable
        assert self._evicting(lambda: self.cache.try_make_room(num_pages)) == could
        if could:
            assert self.pool.num_free >= num_pages

    @rule()
    def reset(self) -> None:
        is_empty = self._evicting(self.cache.reset)
        assert is_empty == (self.cache.num_pages == 0)
        assert self.cache.num_evictable == 0

    # ---- checks ---------------------------------------------------------------------------

    def _evicting(self, action):  # type: ignore[no-untyped-def]
        """Run ``action``: every page that left the cache was used by nobody else."""
        before = {p: self.pool.refcount(p) for p in self.cache.cached_page_ids()}
        result = self._freeing(action)
        for page_id, count in before.items():
            if page_id not in self.cache.cached_page_ids():
                assert count == 1, f"evicted page {page_id} had {count - 1} other owners"
        return result

    def _freeing(self, action):  # type: ignore[no-untyped-def]
        """Run ``action``; a page the pool freed forgets what it held."""
        result = action()
        for page_id in list(self.content):
            if self.pool.refcount(page_id) == 0:
                del self.content[page_id]
        return result

    @invariant()
    def every_reference_has_a_holder(self) -> None:
        self.table.check_integrity(self.in_forward)

    @invariant()
    def cached_pages_are_complete_and_reported(self) -> None:
        for page_id in self.cache.cached_page_ids():
            assert None not in self.content.get(page_id, [None]), f"page {page_id} incomplete"
        assert len(self.events.live) == self.cache.num_pages

    def teardown(self) -> None:
        for request_id in list(self.live):
            self.finish(request_id)
        if self.in_forward:
            self.collect()
        assert self.cache.reset() and not self.events.live
        assert self.pool.num_free == self.pool.num_pages  # no page leaked
        self.table.check_integrity()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_prefix_cache_machine = PrefixCacheMachine.TestCase
