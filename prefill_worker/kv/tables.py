"""Request-to-pages table: which pages of the ``PagePool`` hold which request's prompt.

Page ``i`` of a request's ``page_ids`` holds prompt positions ``[i * page_size, (i + 1) *
page_size)`` (the convention of ``prefill_worker.batch``). A request's pages are reserved
whole before its prefill starts (no mid-prefill eviction) and released in one call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from prefill_worker.kv.pages import PagePool


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PageTable:
    """request_id → its pages, in prompt order; reserves from and releases to one pool."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        assert page_size > 0
        self.pool = pool
        self.page_size = page_size
        self._pages: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pages

    def can_ever_fit(self, num_tokens: int) -> bool:
        """False when the prompt needs more pages than the whole pool has."""
        return num_pages_for(num_tokens, self.page_size) <= self.pool.num_pages

    def try_reserve(self, request_id: str, num_tokens: int) -> tuple[int, ...] | None:
        """Pages for ``num_tokens`` positions, or None when the pool is short right now."""
        assert request_id not in self._pages, f"{request_id} already holds pages"
        page_ids = self.pool.try_alloc(num_pages_for(num_tokens, self.page_size))
        if page_ids is None:
            return None
        self._pages[request_id] = tuple(page_ids)
        return self._pages[request_id]

    def get(self, request_id: str) -> tuple[int, ...]:
        return self._pages[request_id]

    def release(self, request_id: str) -> None:
        self.pool.free(self._pages.pop(request_id))

    def detach(self, request_id: str) -> tuple[int, ...]:
        """Forget the request but keep its pages allocated; the caller frees them later."""
        return self._pages.pop(request_id)

    def check_integrity(self, detached: Iterable[Sequence[int]] = ()) -> None:
        """Every page reference in the pool is one entry of this table (or of ``detached``)."""
        held = Counter(page_id for page_ids in self._pages.values() for page_id in page_ids)
        held.update(page_id for page_ids in detached for page_id in page_ids)
        for page_id in range(self.pool.num_pages):
            assert held[page_id] == self.pool.refcount(page_id), f"page {page_id} leaked"
        self.pool.check_integrity()
