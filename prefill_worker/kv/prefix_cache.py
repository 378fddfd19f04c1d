"""The prefix-cache seam: what the page table asks of a cache of full KV pages.

Two implementations, chosen once at start-up (``cache.prefix_caching``):
``page_cache.PagePrefixCache`` (the hash chain of full pages) and ``NoPrefixCache`` (off: every
page belongs to exactly one request, as before the cache existed).

Ownership rule for both: a page's pool refcount is the number of requests that use it, plus
one while the cache holds it. The page table frees a request's pages through ``release`` (never
``PagePool.free``), so the cache sees a page become idle.

Speculative work (a prefill before its decode claimed it: optimistic prefill) must not evict
what claimed requests left: a cached page is *trusted* once a request that was not speculative
released it, and speculative admission and storing evict only idle pages nobody trusts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefill_worker.kv.pages import PagePool


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of one prompt: pages holding its first ``num_tokens`` positions.

    ``num_tokens`` is a multiple of the page size and below the prompt's length (its last
    token is always computed, to sample the first token). ``block_hashes[i]`` is the hash of
    ``page_ids[i]``'s block. ``num_query_tokens`` is the prompt length looked up (0 when the
    cache is off): the metrics' ``prefix_cache_queries``, as ``num_tokens`` is its hits."""

    page_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()
    num_tokens: int = 0
    num_query_tokens: int = 0


MISS = PrefixHit()


class PrefixCache(Protocol):
    """Full pages shared by content; engine thread only. Never blocks, never raises on
    no-space: it answers with a shorter hit, a shorter chain, or False."""

    @property
    def num_pages(self) -> int:
        """Pages the cache holds (in use by requests or idle)."""
        ...

    @property
    def num_evictable(self) -> int:
        """Idle pages: held by the cache alone, so admission may evict them."""
        ...

    def match(self, token_ids: Sequence[int], max_hit_tokens: int | None = None) -> PrefixHit:
        """The longest cached prefix of whole pages, leaving at least the last token, and no
        longer than ``max_hit_tokens`` when given. Pure: nothing is reserved until
        ``acquire``."""
        ...

    def acquire(self, page_ids: Sequence[int]) -> None:
        """A request takes a reference on each of these cached pages (a hit)."""
        ...

    def release(self, page_ids: Sequence[int], trusted: bool = True) -> None:
        """A request drops its reference on each page; cached ones left idle become
        evictable (the prompt's last pages first). ``trusted``: the request was claimed (not
        speculative): its cached pages are trusted from now on."""
        ...

    def store(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        chain: tuple[int, ...],
        end: int,
        speculative: bool = False,
    ) -> tuple[int, ...]:
        """Pages ``[len(chain), end)`` of a prompt now hold their complete K/V: cache the ones
        whose content is not cached yet. ``chain`` holds the block hashes of pages
        ``[0, len(chain))``, all cached. Returns the chain as far as pages are now cached;
        shorter than ``end`` means it broke (cap reached and nothing idle, a collision, an
        evicted parent) and the caller stops storing this prompt. ``speculative``: at the cap
        only an untrusted idle page may make room."""
        ...

    def try_make_room(self, num_pages: int, speculative: bool = False) -> bool:
        """Evict idle pages, least recently used first, until the pool has ``num_pages``
        free; evicts nothing and answers False when even all idle pages would not do.
        ``speculative``: only idle pages nobody trusts count."""
        ...

    def reset(self) -> bool:
        """Evict every idle page; True when the cache is then empty."""
        ...

    def cached_page_ids(self) -> Collection[int]:
        """Every page the cache holds a reference on."""
        ...

    def cached_hashes(self) -> Collection[int]:
        """The block hash of every cached page."""
        ...

    def watch(self, on_evicted: Callable[[Sequence[int]], None]) -> None:
        """Call ``on_evicted`` with the block hashes of the pages each eviction drops (a
        windowed sliding pool's kept windows go with them: ``kv.sliding``)."""
        ...

    def check_integrity(self) -> None: ...


class NoPrefixCache:
    """The cache switched off: nothing hits, nothing is kept after its request."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool

    @property
    def num_pages(self) -> int:
        return 0

    @property
    def num_evictable(self) -> int:
        return 0

    def match(self, token_ids: Sequence[int], max_hit_tokens: int | None = None) -> PrefixHit:
        return MISS

    def acquire(self, page_ids: Sequence[int]) -> None:
        assert not page_ids, "nothing is cached"

    def release(self, page_ids: Sequence[int], trusted: bool = True) -> None:
        self._pool.free(page_ids)

    def store(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        chain: tuple[int, ...],
        end: int,
        speculative: bool = False,
    ) -> tuple[int, ...]:
        return chain

    def try_make_room(self, num_pages: int, speculative: bool = False) -> bool:
        return self._pool.num_free >= num_pages

    def reset(self) -> bool:
        return True

    def cached_page_ids(self) -> Collection[int]:
        return ()

    def cached_hashes(self) -> Collection[int]:
        return ()

    def watch(self, on_evicted: Callable[[Sequence[int]], None]) -> None:
        return None  # nothing is ever evicted

    def check_integrity(self) -> None:
        return None
