"""The sliding layers' own page space (``cache.sliding_pool: windowed``): which of the sliding
pool's pages hold which request's last window, docs/models.md ("The sliding-window pool").

Torch-free, plain ints. A full-attention layer keeps a page for every prompt page (``tables``);
a sliding layer of window ``w`` (keys a query sees, itself included) needs, for a chunk of
positions ``[start, end)``, only positions ``[start - w + 1, end)``. A request's sliding pages
are a list indexed like its full pages (entry ``i`` holds positions ``[i * ps, (i + 1) * ps)``
of every sliding layer), with ``-1`` where no sliding page is held::

    prompt page    0    1    2    3    4    5    6    7        chunk [96, 128), ps 16, w 33
    full pages     f0   f1   f2   f3   f4   f5   f6   f7
    sliding        -1   -1   -1   -1   s9   s2   s3   s4       positions [64, 128) held:
                                                               64 = 96 - 33 + 1
``pages_for(start, end)`` allocates the entries ``[start - w + 1, end)`` needs before the chunk
is planned; ``chunk_done(next_start)`` frees every entry wholly below ``next_start - w + 1``
once the chunk's forward ran (no query of a later chunk sees them), so after the last chunk
a request holds only its last window, what a windowed transfer sends.

Bounds: the next chunk is planned before the previous one's forward is consumed (overlapped
forwards), so a prefilling request holds at most ``w - 1 + 2 * chunk_size`` positions: its
*quota*, ``max_pages_per_request``. ``try_reserve`` admits a request only when the pool's free
pages cover every running request's unspent quota and its own, so ``pages_for`` never runs
short mid-prefill; after the last chunk the quota shrinks to what is held.

Invariants (``check_integrity``): every held page has refcount 1 and is one request's entry;
a request holds at most its quota; the unspent quotas sum to ``quota - held`` over requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefill_worker.kv.pages import PagePool

NO_PAGE = -1  # an entry whose positions no sliding layer needs any more


def max_pages_per_request(window: int, chunk_size: int, page_size: int) -> int:
    """Sliding pages a prefilling request may hold at once: ``window - 1`` positions before
    its chunk and two chunks (the next one is planned before this one's forward ends), at
    any page alignment."""
    span = window - 1 + 2 * chunk_size
    return -(-span // page_size) + 1


def sliding_pool_pages(
    window: int, chunk_size: int, page_size: int, max_running_requests: int
) -> int:
    """The sliding pool's default size: every running request's quota."""
    return max_running_requests * max_pages_per_request(window, chunk_size, page_size)


@dataclass(slots=True)
class _Sliding:
    num_tokens: int  # the prompt's length
    quota: int  # pages it may hold at most
    entries: list[int] = field(default_factory=list)  # per prompt page: a page id or NO_PAGE

    @property
    def held(self) -> list[int]:
        return [p for p in self.entries if p != NO_PAGE]


class SlidingPageTable:
    """request_id → its sliding pages; reserves quotas from and frees to one pool."""

    def __init__(self, pool: PagePool, page_size: int, window: int, chunk_size: int) -> None:
        assert page_size > 0 and window > 0 and chunk_size > 0
        self.pool, self.page_size, self.window = pool, page_size, window
        self.quota = max_pages_per_request(window, chunk_size, page_size)
        if self.quota > pool.num_pages:
            raise ValueError(
                f"cache.sliding_pages {pool.num_pages}: one request's window and two chunks "
                f"need {self.quota} (window {window}, chunk_size {chunk_size}, page_size "
                f"{page_size})"
            )
        self._held: dict[str, _Sliding] = {}
        self._unspent = 0  # quotas not yet allocated, summed over requests

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    @property
    def num_available_pages(self) -> int:
        """Free pages no running request's quota already counts on."""
        return self.pool.num_free - self._unspent

    def try_reserve(self, request_id: str, num_tokens: int) -> bool:
        """Count the request's quota against the pool; False (nothing changed) when short."""
        assert request_id not in self._held, f"{request_id} already holds sliding pages"
        quota = min(self.quota, -(-num_tokens // self.page_size))
        if quota > self.num_available_pages:
            return False
        self._held[request_id] = _Sliding(num_tokens, quota)
        self._unspent += quota
        return True

    def pages_for(self, request_id: str, start: int, end: int) -> tuple[int, ...]:
        """The request's entries for a chunk of positions ``[start, end)`` (one per prompt
        page up to ``end``), allocating those the chunk reads or writes that are not held."""
        held = self._held[request_id]
        num_entries = -(-end // self.page_size)
        held.entries += [NO_PAGE] * (num_entries - len(held.entries))
        first = max(0, start - self.window + 1) // self.page_size
        missing = [i for i in range(first, num_entries) if held.entries[i] == NO_PAGE]
        page_ids = self.pool.try_alloc(len(missing))
        assert page_ids is not None, "the quota promised the pages"
        for index, page_id in zip(missing, page_ids, strict=True):
            held.entries[index] = page_id
        self._unspent -= len(missing)
        assert self._unspent >= 0 and len(held.held) <= held.quota, f"{request_id} over quota"
        return tuple(held.entries)

    def get(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._held[request_id].entries)

    def chunk_done(self, request_id: str, next_start: int) -> None:
        """The forward of the chunk ending at ``next_start`` ran: free the pages no later
        query sees; after the last chunk the quota shrinks to the last window held."""
        held = self._held[request_id]
        end = min(len(held.entries), max(0, next_start - self.window + 1) // self.page_size)
        gone = [p for p in held.entries[:end] if p != NO_PAGE]
        held.entries[:end] = [NO_PAGE] * end
        self.pool.free(gone)
        self._unspent += len(gone)
        if next_start >= held.num_tokens:  # the last chunk: no page is allocated any more
            num_held = len(held.held)
            self._unspent -= held.quota - num_held
            held.quota = num_held

    def release(self, request_id: str) -> None:
        """Every page and the unspent quota back (finish, abort, failure, shutdown)."""
        held = self._held.pop(request_id)
        held_ids = held.held
        self._unspent -= held.quota - len(held_ids)
        self.pool.free(held_ids)

    def check_integrity(self) -> None:
        owners = [p for held in self._held.values() for p in held.held]
        for request_id, held in self._held.items():
            assert len(held.held) <= held.quota, f"{request_id} holds more than its quota"
        assert len(owners) == len(set(owners)), "a sliding page has two owners"
        for page_id in owners:
            assert self.pool.refcount(page_id) == 1, f"sliding page {page_id}"
        assert self.pool.num_used == len(owners), "a sliding page leaked"
        unspent = sum(h.quota - len(h.held) for h in self._held.values())
        assert unspent == self._unspent >= 0, f"unspent quota {self._unspent} != {unspent}"
        self.pool.check_integrity()
