"""Request-to-pages table: which pages of the ``PagePool`` hold which request's prompt.

Page ``i`` of a request's ``page_ids`` holds prompt positions ``[i * page_size, (i + 1) *
page_size)`` (the convention of ``prefill_worker.batch``). A request's pages are reserved
whole before its prefill starts (no mid-prefill eviction) and released in one call. With a
prefix cache, the first pages may be a hit (shared, already computed)::

    page_ids   [ hit 0 ][ hit 1 ][ new 2 ][ new 3 ][ new 4 ]
                 cached, refcount >= 2    allocated for this request; each enters the cache
                                          once ``commit`` says its K/V is complete

Every page goes back through the cache's ``release``, so the cache sees pages go idle. With a
windowed sliding pool (``kv.sliding``) the table also owns each request's sliding entries:
reserved with its pages, grown per planned chunk (``sliding_pages_for``), trimmed after each
chunk (``chunk_done``) and released with its pages on every path. A hit then also needs its
window kept in the sliding pool (``lookup`` truncates it to one that is); a request released
keeps its cached chain's window there, and the cache's evictions drop windows
(docs/prefix-cache.md, "A windowed sliding pool"). A *speculative* request
(optimistic prefill, before its decode claimed it) evicts and stores only what no claimed
request trusts (``prefix_cache``) until ``claim``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.prefix_cache import MISS, NoPrefixCache, PrefixCache, PrefixHit
from prefill_worker.kv.sliding import SlidingPageTable


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(slots=True)
class _Held:
    page_ids: tuple[int, ...]
    token_ids: Sequence[int]
    chain: tuple[int, ...]  # block hashes of pages [0, len(chain)), all in the cache
    is_storing: bool = True  # False once the chain broke: this prompt stores no more pages
    speculative: bool = False  # not claimed yet: evicts and trusts nothing


@dataclass(frozen=True, slots=True)
class Detached:
    """A request that ended while a forward used its pages (``PageTable.detach``): its full
    pages and sliding pages, both freed once that forward was collected."""

    page_ids: tuple[int, ...]
    sliding_page_ids: tuple[int, ...] = ()


class PageTable:
    """request_id → its pages, in prompt order; reserves from and releases to one pool,
    through one prefix cache (``NoPrefixCache`` when none is given)."""

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        cache: PrefixCache | None = None,
        sliding: SlidingPageTable | None = None,
        *,
        pins: PagePins | None = None,
    ) -> None:
        """``sliding``: a windowed sliding pool's bookkeeping (``kv.sliding``); ``pins``:
        pages transfers keep past their requests (``kv.pins``), over ``pool``."""
        assert page_size > 0
        assert pins is None or pins.pool is pool, "pins over another pool"
        self.pool = pool
        self.page_size = page_size
        self.cache: PrefixCache = cache or NoPrefixCache(pool)
        self.sliding = sliding
        self._pins = pins
        if pins is not None:
            pins.bind(self.cache)
        if sliding is not None:  # an evicted block's kept window goes with it
            self.cache.watch(sliding.forget_windows)
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    @property
    def num_available_pages(self) -> int:
        """Pages a new request could get now: free ones and idle cached ones."""
        return self.pool.num_free + self.cache.num_evictable

    def can_ever_fit(self, num_tokens: int) -> bool:
        """False when the prompt needs more pages than the whole pool has."""
        return num_pages_for(num_tokens, self.page_size) <= self.pool.num_pages

    def lookup(self, token_ids: Sequence[int], max_hit_tokens: int | None = None) -> PrefixHit:
        """The prompt's cached prefix (at most ``max_hit_tokens`` tokens, rounded down to
        whole pages; with a windowed sliding pool, to the longest whose window is kept);
        nothing is reserved yet."""
        hit = self.cache.match(token_ids, max_hit_tokens)
        if self.sliding is None or not hit.page_ids:
            return hit
        num_pages = self.sliding.usable_pages(hit.block_hashes)
        return PrefixHit(
            hit.page_ids[:num_pages],
            hit.block_hashes[:num_pages],
            num_pages * self.page_size,
            hit.num_query_tokens,
        )

    def try_reserve(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hit: PrefixHit = MISS,
        speculative: bool = False,
    ) -> tuple[int, ...] | None:
        """The hit's pages and new ones for the rest of the prompt, or None when the pool is
        short even after evicting every idle cached page it may (then nothing changed)."""
        assert request_id not in self._held, f"{request_id} already holds pages"
        num_new = num_pages_for(len(token_ids), self.page_size) - len(hit.page_ids)
        sliding = self.sliding
        key = hit.block_hashes[-1] if hit.block_hashes else None  # its kept window's
        if sliding is not None and not sliding.try_reserve(
            request_id, len(token_ids), key, len(hit.page_ids)
        ):
            return None
        self.cache.acquire(hit.page_ids)  # first: the hit's own pages must not be evicted
        if not self.cache.try_make_room(num_new, speculative):
            self.cache.release(hit.page_ids)
            if sliding is not None:
                sliding.release(request_id)
            return None
        new_ids = self.pool.try_alloc(num_new)
        assert new_ids is not None, "try_make_room promised the pages"
        page_ids = hit.page_ids + tuple(new_ids)
        self._held[request_id] = _Held(page_ids, token_ids, hit.block_hashes, True, speculative)
        return page_ids

    def claim(self, request_id: str) -> None:
        """The request is not speculative any more: its decode claimed it."""
        self._held[request_id].speculative = False

    def num_speculative_pages(self) -> int:
        """Pages held by speculative requests (a shared page once per holder)."""
        return sum(len(h.page_ids) for h in self._held.values() if h.speculative)

    def get(self, request_id: str) -> tuple[int, ...]:
        return self._held[request_id].page_ids

    def sliding_pages_for(self, request_id: str, start: int, end: int) -> tuple[int, ...]:
        """The request's sliding entries for a chunk ``[start, end)`` (``kv.sliding``); ()
        without a windowed sliding pool."""
        if self.sliding is None:
            return ()
        return self.sliding.pages_for(request_id, start, end)

    def sliding_entries(self, request_id: str) -> tuple[int, ...]:
        """The request's sliding entries as held now (``kv.sliding``); () without a windowed
        sliding pool."""
        if self.sliding is None:
            return ()
        return self.sliding.get(request_id)

    def chunk_done(self, request_id: str, next_start: int) -> None:
        """The forward of the chunk ending at ``next_start`` ran: its full pages may be
        shared (``commit``), and sliding pages no later query sees go back."""
        self.commit(request_id, next_start)
        if self.sliding is not None:
            self.sliding.chunk_done(request_id, next_start)

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The K/V of prompt positions ``[0, num_tokens)`` is complete: its full pages may
        be shared from now on."""
        held = self._held[request_id]
        end = num_tokens // self.page_size
        if not held.is_storing or end <= len(held.chain):
            return
        held.chain = self.cache.store(
            held.token_ids, held.page_ids, held.chain, end, held.speculative
        )
        held.is_storing = len(held.chain) == end

    def release(self, request_id: str) -> None:
        """Every page back; with a windowed sliding pool the window of its cached chain is
        kept (``kv.sliding``), so a later prompt sharing that prefix may hit it."""
        held = self._held.pop(request_id)
        self.cache.release(held.page_ids, trusted=not held.speculative)
        sliding = self.sliding
        if sliding is None:
            return
        if held.chain and held.chain[-1] in self.cache.cached_hashes():
            sliding.keep_window(request_id, held.chain[-1], len(held.chain))
        sliding.release(request_id)

    def detach(self, request_id: str) -> Detached:
        """Forget the request but keep its pages, full and sliding, allocated while the
        forward in flight uses them; ``free_detached`` once it was collected. It keeps no
        window for the prefix cache."""
        sliding = () if self.sliding is None else self.sliding.detach(request_id)
        return Detached(self._held.pop(request_id).page_ids, sliding)

    def free_detached(self, detached: Detached, trusted: bool = True) -> None:
        """``trusted``: as ``release`` would have (the request was not speculative)."""
        self.cache.release(detached.page_ids, trusted)
        if self.sliding is not None:
            self.sliding.free_detached(detached.sliding_page_ids)

    def check_integrity(self, detached: Iterable[Detached] = ()) -> None:
        """Every page reference in the pool is one entry of this table (or of ``detached``),
        a pin, or the cache's own."""
        detached = list(detached)
        held = Counter(page_id for h in self._held.values() for page_id in h.page_ids)
        held.update(page_id for d in detached for page_id in d.page_ids)
        held.update(self.cache.cached_page_ids())
        if self._pins is not None:
            held.update(self._pins.pinned())
        for page_id in range(self.pool.num_pages):
            assert held[page_id] == self.pool.refcount(page_id), f"page {page_id} leaked"
        self.pool.check_integrity()
        self.cache.check_integrity()
        if self.sliding is not None:
            self.sliding.check_integrity(d.sliding_page_ids for d in detached)
            cached = self.cache.cached_hashes()
            assert all(k in cached for k in self.sliding.window_keys()), "a window uncached"
