"""The sliding layers' own page space (``cache.sliding_pool: windowed``): which of the sliding
pool's pages hold which request's last window, and the windows kept for prefix hits,
docs/models.md ("The sliding-window pool").

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
a request holds only its last window (for the prompt's last whole page's end, one page more
at most), what a windowed transfer sends.

Prefix hits (docs/prefix-cache.md, "A windowed sliding pool"): a full-page prefix of ``h``
tokens is usable only with its sliding layers' positions ``[h - w + 1, h)``. When a request
whose cached chain ends at ``h`` goes, ``keep_window`` keeps those pages (one more reference
each) under the block hash of the chain's last page; a request hitting it starts its entries
with them (``try_reserve``: *shared*, read and never written, since its first chunk writes
from the page-aligned ``h`` on into pages of its own). A kept window goes when the prefix
cache evicts that block (``forget_windows``), or, least recently used first, when a
reservation is short of pages.

Bounds: the next chunk is planned before the previous one's forward is consumed (overlapped
forwards), so a prefilling request holds at most ``w - 1 + 2 * chunk_size`` positions of its
own: its *quota*, ``max_pages_per_request``. ``try_reserve`` admits a request only when the
pool's free pages cover every running request's unspent quota and its own, so ``pages_for``
never runs short mid-prefill; after the last chunk the quota shrinks to what is held.

Invariants (``check_integrity``): a page's refcount is the requests holding it plus the kept
windows naming it; a request's own pages are nobody else's; it owns at most its quota; the
unspent quotas sum to ``quota - owned`` over requests.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
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
    quota: int  # pages of its own it may hold at most
    entries: list[int] = field(default_factory=list)  # per prompt page: a page id or NO_PAGE
    shared: set[int] = field(default_factory=set)  # a kept window's pages: read, not owned

    @property
    def held(self) -> list[int]:
        return [p for p in self.entries if p != NO_PAGE]

    @property
    def owned(self) -> list[int]:
        return [p for p in self.entries if p != NO_PAGE and p not in self.shared]


class SlidingPageTable:
    """request_id → its sliding pages; reserves quotas from and frees to one pool; keeps the
    windows of cached prefixes (block hash of a chain's last page → its window's pages)."""

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
        self._windows: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # LRU first

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    @property
    def num_available_pages(self) -> int:
        """Free pages no running request's quota already counts on."""
        return self.pool.num_free - self._unspent

    @property
    def num_kept_pages(self) -> int:
        """Pages the kept windows hold (a page of two windows once)."""
        return len({p for pages in self._windows.values() for p in pages})

    @property
    def num_held_pages(self) -> int:
        """Pages requests hold (the metrics' "used"): the pool's, less those only kept
        windows hold."""
        kept = Counter(p for pages in self._windows.values() for p in pages)
        return self.pool.num_used - sum(1 for p, n in kept.items() if self.pool.refcount(p) == n)

    def window_first(self, num_pages: int) -> int:
        """The first prompt page a prefix of ``num_pages`` pages' window needs."""
        return max(0, num_pages * self.page_size - self.window + 1) // self.page_size

    def usable_pages(self, block_hashes: Sequence[int]) -> int:
        """How many of a hit's pages (their block hashes, in prompt order) are usable: the
        longest prefix whose last page's window is kept; 0 when none is."""
        for num_pages in range(len(block_hashes), 0, -1):
            if block_hashes[num_pages - 1] in self._windows:
                return num_pages
        return 0

    def try_reserve(
        self, request_id: str, num_tokens: int, key: int | None = None, num_hit_pages: int = 0
    ) -> bool:
        """Count the request's quota against the pool, evicting kept windows (least recently
        used first, never ``key``'s) while short; False (nothing changed) when even that would
        not do. ``key``: the kept window of its prefix hit of ``num_hit_pages`` pages, which
        its entries start with."""
        assert request_id not in self._held, f"{request_id} already holds sliding pages"
        quota = min(self.quota, -(-num_tokens // self.page_size))
        if not self._make_room(quota - self.num_available_pages, key):
            return False
        held = self._held[request_id] = _Sliding(num_tokens, quota)
        self._unspent += quota
        if key is not None:
            pages = self._windows[key]
            self._windows.move_to_end(key)
            first = self.window_first(num_hit_pages)
            assert len(pages) == num_hit_pages - first, f"window {key} of {len(pages)} pages"
            self.pool.incref(pages)
            held.entries = [NO_PAGE] * first + list(pages)
            held.shared = set(pages)
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
        assert self._unspent >= 0 and len(held.owned) <= held.quota, f"{request_id} over quota"
        return tuple(held.entries)

    def get(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._held[request_id].entries)

    def chunk_done(self, request_id: str, next_start: int) -> None:
        """The forward of the chunk ending at ``next_start`` ran: free the pages no later
        query sees (after the last chunk, those before the window of the prompt's last whole
        page's end: what a kept window needs); the quota then shrinks to what is held."""
        held = self._held[request_id]
        keep_from = min(next_start, held.num_tokens // self.page_size * self.page_size)
        end = min(len(held.entries), max(0, keep_from - self.window + 1) // self.page_size)
        gone = [p for p in held.entries[:end] if p != NO_PAGE]
        held.entries[:end] = [NO_PAGE] * end
        self.pool.free(gone)
        self._unspent += sum(1 for p in gone if p not in held.shared)
        held.shared.difference_update(gone)
        if next_start >= held.num_tokens:  # the last chunk: no page is allocated any more
            num_owned = len(held.owned)
            self._unspent -= held.quota - num_owned
            held.quota = num_owned

    def keep_window(self, request_id: str, key: int, num_pages: int) -> bool:
        """Keep the window of the request's first ``num_pages`` prompt pages (a cached chain
        whose last block hash is ``key``), before ``release``; False when a page of it is not
        held or a window is kept for ``key`` already."""
        entries = self._held[request_id].entries
        pages = entries[self.window_first(num_pages) : num_pages]
        if key in self._windows or len(entries) < num_pages or NO_PAGE in pages:
            return False
        self.pool.incref(pages)
        self._windows[key] = tuple(pages)
        return True

    def forget_windows(self, keys: Iterable[int]) -> None:
        """The prefix cache evicted these blocks: their kept windows' pages go."""
        for key in keys:
            pages = self._windows.pop(key, None)
            if pages is not None:
                self.pool.free(pages)

    def window_keys(self) -> Sequence[int]:
        return tuple(self._windows)

    def release(self, request_id: str) -> None:
        """Every page and the unspent quota back (finish, abort, failure, shutdown)."""
        self.pool.free(self.detach(request_id))

    def detach(self, request_id: str) -> tuple[int, ...]:
        """Forget the request and give its unspent quota back, but keep its pages: a forward
        still reads and writes them; ``free_detached`` once it was collected."""
        held = self._held.pop(request_id)
        self._unspent -= held.quota - len(held.owned)
        return tuple(held.held)

    def free_detached(self, page_ids: Sequence[int]) -> None:
        self.pool.free(page_ids)

    def check_integrity(self, detached: Iterable[Sequence[int]] = ()) -> None:
        """``detached``: pages ``detach`` handed out, not freed yet."""
        owned = [p for held in self._held.values() for p in held.owned]
        for request_id, held in self._held.items():
            assert len(held.owned) <= held.quota, f"{request_id} holds more than its quota"
        assert len(owned) == len(set(owned)), "a sliding page has two owners"
        refs = Counter(p for held in self._held.values() for p in held.held)
        refs.update(p for pages in self._windows.values() for p in pages)
        refs.update(p for pages in detached for p in pages)
        assert not set(owned) & {p for w in self._windows.values() for p in w}, "owned, kept"
        for page_id, count in refs.items():
            assert self.pool.refcount(page_id) == count, f"sliding page {page_id}"
        assert self.pool.num_used == len(refs), "a sliding page leaked"
        unspent = sum(h.quota - len(h.owned) for h in self._held.values())
        assert unspent == self._unspent >= 0, f"unspent quota {self._unspent} != {unspent}"
        self.pool.check_integrity()

    def _make_room(self, short: int, keep: int | None) -> bool:
        """Evict kept windows, least recently used first (never ``keep``), until ``short``
        pages more are free; False, evicting nothing, when all of them would not do."""
        if short <= 0:
            return True
        drops: Counter[int] = Counter()
        victims, freed = [], 0
        for key, pages in self._windows.items():
            if freed >= short:
                break
            if key == keep:
                continue
            victims.append(key)
            drops.update(pages)
            freed += sum(1 for p in set(pages) if drops[p] == self.pool.refcount(p))
        if freed < short:
            return False
        self.forget_windows(victims)
        return True
