"""Pages a transfer keeps after their request ended: a vLLM decode still to READ them, or
our WRITE into its blocks still to run, when the pool itself is in vLLM's block layout
(``kv.layout`` ``vllm_blocks``, docs/vllm.md: no staging region, the pool's pages are the
blocks).

A pin is one more reference on each page (``PagePool.incref``), taken while the request
still holds the pages, so nothing reuses them and the prefix cache evicts none of them::

    page refcount = requests using it + pins + 1 if cached

``unpin`` drops the pin through the prefix cache (``bind``) so a cached page left with the
cache's reference alone becomes evictable, as a request's release makes it. Engine thread
only, as the pool is. ``PageTable.check_integrity`` counts the pins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.prefix_cache import PrefixCache


class PagePins:
    """The pins on one ``PagePool``; ``bind`` the prefix cache over it before any unpin of a
    cached page (the engine's ``PageTable`` does, as it is made)."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._cache: PrefixCache | None = None
        self._pinned: Counter[int] = Counter()

    def bind(self, cache: PrefixCache) -> None:
        self._cache = cache

    def pin(self, page_ids: Sequence[int]) -> None:
        """Keep pages a request holds now (each must be in use) until ``unpin``."""
        self.pool.incref(page_ids)
        self._pinned.update(page_ids)

    def unpin(self, page_ids: Sequence[int]) -> None:
        """Drop one pin per page; a page nobody else holds returns to the pool."""
        for page_id in page_ids:
            assert self._pinned[page_id] > 0, f"page {page_id} is not pinned"
            self._pinned[page_id] -= 1
            if not self._pinned[page_id]:
                del self._pinned[page_id]
        if self._cache is not None:
            self._cache.release(page_ids)  # trusted: only claimed requests' pages are pinned
        else:
            self.pool.free(page_ids)

    @property
    def num_pinned(self) -> int:
        """Pins held (a page pinned twice counts twice)."""
        return sum(self._pinned.values())

    def pinned(self) -> Counter[int]:
        """Each pinned page and its pins (a copy)."""
        return Counter(self._pinned)
