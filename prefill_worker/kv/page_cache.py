"""The prefix cache: full KV pages addressed by a hash chain, shared by reference count.

Torch-free. One entry per distinct block (``block_hash.py``), keyed by its chained hash::

    blocks    block hash -> (page id, parent hash, packed tokens)     at most max_pages
    hash_of   page id    -> block hash
    idle      page ids the cache alone holds, least recently released first (the LRU)
    trusted   page ids a claimed (not speculative) request released
    untrusted the idle pages not trusted, in the same order: all speculative work may evict

    page refcount = requests using it + 1 (the cache)   refcount 1 <=> the page is idle

A lookup stops at the first miss, and a hash collision is a miss. A page enters the cache only
once its K/V is complete (``store``), so no request hits a page another one is still writing.
Eviction takes idle pages only, oldest first, only when needed. What a request sees, and why
a chain and not a tree: docs/prefix-cache.md. Every page stored and evicted is reported to a
``CacheEventSink`` (KV events: docs/kv-events.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from prefill_worker.kv.block_hash import block_hash, pack_block
from prefill_worker.kv.cache_events import CacheEventSink, NullCacheEvents
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.prefix_cache import PrefixHit

BlockHasher = Callable[[int | None, bytes], int]  # (parent hash, packed tokens) -> hash


@dataclass(frozen=True, slots=True)
class _Block:
    page_id: int
    parent: int | None  # the hash of the block before it; None for a prompt's first block
    tokens: bytes  # the block's token ids, packed: compared on every hit


class PagePrefixCache:
    """Implements ``prefix_cache.PrefixCache`` over one ``PagePool``; engine thread only."""

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_pages: int | None = None,
        events: CacheEventSink | None = None,
        hasher: BlockHasher = block_hash,
    ) -> None:
        """``hasher`` is ``block_hash.block_hash``; tests give a weak one to force collisions."""
        assert page_size > 0 and (max_pages is None or max_pages >= 0)
        self._pool = pool
        self._hash = hasher
        self.page_size = page_size
        self.max_pages = pool.num_pages if max_pages is None else min(max_pages, pool.num_pages)
        self._events: CacheEventSink = events or NullCacheEvents()
        self._blocks: dict[int, _Block] = {}
        self._hash_of: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._trusted: set[int] = set()
        self._untrusted: OrderedDict[int, None] = OrderedDict()
        self._watchers: list[Callable[[Sequence[int]], None]] = []

    @property
    def num_pages(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable(self) -> int:
        return len(self._idle)

    def match(self, token_ids: Sequence[int], max_hit_tokens: int | None = None) -> PrefixHit:
        ps = self.page_size
        page_ids: list[int] = []
        hashes: list[int] = []
        parent = None
        limit = len(token_ids) - 1  # the last token: computed
        if max_hit_tokens is not None:
            limit = min(limit, max_hit_tokens)
        for start in range(0, limit - ps + 1, ps):
            packed = pack_block(token_ids, start, ps)
            found = self._find(parent, packed)
            if found is None:
                break
            parent, block = found
            page_ids.append(block.page_id)
            hashes.append(parent)
        return PrefixHit(tuple(page_ids), tuple(hashes), len(page_ids) * ps, len(token_ids))

    def acquire(self, page_ids: Sequence[int]) -> None:
        self._pool.incref(page_ids)
        for page_id in page_ids:
            assert page_id in self._hash_of, f"page {page_id} is not cached"
            self._idle.pop(page_id, None)
            self._untrusted.pop(page_id, None)

    def release(self, page_ids: Sequence[int], trusted: bool = True) -> None:
        self._pool.free(page_ids)
        for page_id in reversed(page_ids):
            if page_id not in self._hash_of:
                continue
            if trusted:
                self._trusted.add(page_id)
            if self._pool.refcount(page_id) == 1:
                self._idle[page_id] = None
                if page_id not in self._trusted:
                    self._untrusted[page_id] = None

    def store(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        chain: tuple[int, ...],
        end: int,
        speculative: bool = False,
    ) -> tuple[int, ...]:
        grown = list(chain)
        run: list[int] = []  # hashes of the pages stored just now, consecutive
        for index in range(len(chain), end):
            parent = grown[-1] if grown else None
            packed = pack_block(token_ids, index * self.page_size, self.page_size)
            digest = self._hash(parent, packed)
            known = self._blocks.get(digest)
            if known is not None and (known.parent != parent or known.tokens != packed):
                break  # a 64-bit collision: this prompt's blocks stay out
            if known is None:
                if len(self._blocks) >= self.max_pages:  # at the cap: evict one idle page
                    run = self._report_stored(token_ids, grown, run)  # reported before it goes
                    if self._evict(1, speculative) == 0:
                        break  # every cached page is in use
                if parent is not None and parent not in self._blocks:
                    break  # its parent was another request's page, and it was evicted
                self._insert(digest, _Block(page_ids[index], parent, packed))
                run.append(digest)
            else:  # the same content is cached in another page: ours stays the request's
                run = self._report_stored(token_ids, grown, run)
            grown.append(digest)
        self._report_stored(token_ids, grown, run)
        return tuple(grown)

    def try_make_room(self, num_pages: int, speculative: bool = False) -> bool:
        short = num_pages - self._pool.num_free
        if short <= 0:
            return True
        if short > len(self._untrusted if speculative else self._idle):
            return False
        self._evict(short, speculative)
        return True

    def reset(self) -> bool:
        if not self._blocks:
            return True
        if len(self._idle) == len(self._blocks):
            self._evict(len(self._idle), report=False)
            self._events.all_cleared()
        else:
            self._evict(len(self._idle))
        return not self._blocks

    def cached_page_ids(self) -> Collection[int]:
        return self._hash_of.keys()

    def cached_hashes(self) -> Collection[int]:
        return self._blocks.keys()

    def watch(self, on_evicted: Callable[[Sequence[int]], None]) -> None:
        self._watchers.append(on_evicted)

    def check_integrity(self) -> None:
        assert len(self._blocks) == len(self._hash_of) <= self.max_pages
        for digest, block in self._blocks.items():
            assert self._hash_of[block.page_id] == digest
            count = self._pool.refcount(block.page_id)
            assert count >= 1, f"cached page {block.page_id} is free"
            assert (count == 1) == (block.page_id in self._idle), f"page {block.page_id}: {count}"
        assert all(page_id in self._hash_of for page_id in self._idle)
        assert self._trusted <= self._hash_of.keys()
        untrusted = [p for p in self._idle if p not in self._trusted]
        assert list(self._untrusted) == untrusted, "the untrusted idle pages, in LRU order"

    # ---- internals --------------------------------------------------------------------

    def _find(self, parent: int | None, packed: bytes) -> tuple[int, _Block] | None:
        digest = self._hash(parent, packed)
        block = self._blocks.get(digest)
        if block is None or block.parent != parent or block.tokens != packed:
            return None
        return digest, block

    def _insert(self, digest: int, block: _Block) -> None:
        assert block.page_id not in self._hash_of, f"page {block.page_id} is cached twice"
        self._pool.incref((block.page_id,))  # the cache's own reference
        self._blocks[digest] = block
        self._hash_of[block.page_id] = digest

    def _evict(self, num_pages: int, speculative: bool = False, report: bool = True) -> int:
        """Drop the cache's reference on the ``num_pages`` least recently idle pages (only
        untrusted ones for ``speculative`` work)."""
        source, other = self._idle, self._untrusted
        if speculative:
            source, other = other, source
        page_ids, hashes = [], []
        for _ in range(min(num_pages, len(source))):
            page_id, _ = source.popitem(last=False)
            other.pop(page_id, None)
            self._trusted.discard(page_id)
            digest = self._hash_of.pop(page_id)
            del self._blocks[digest]
            page_ids.append(page_id)
            hashes.append(digest)
        self._pool.free(sorted(page_ids))  # sorted: adjacent pages free as one run
        for on_evicted in self._watchers:
            on_evicted(hashes)
        if hashes and report:
            self._events.blocks_removed(hashes)
        return len(page_ids)

    def _report_stored(
        self, token_ids: Sequence[int], chain: list[int], run: list[int]
    ) -> list[int]:
        """Report ``run``, the tail of ``chain``: consecutive blocks stored in this call. The
        next run starts empty."""
        if not run:
            return run
        first = len(chain) - len(run)
        parent = chain[first - 1] if first > 0 else None
        ps = self.page_size
        tokens = [int(t) for t in token_ids[first * ps : len(chain) * ps]]
        self._events.blocks_stored(tuple(run), parent, tokens, ps)
        return []
