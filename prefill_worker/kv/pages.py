"""The KV page pool: which of the ``num_pages`` pages are free, and how many owners each has.

Torch-free: pages are plain ints; the device tensors live in the model runner. Free pages are
kept as maximal runs of adjacent ids, because a transfer coalesces adjacent pages into one
descriptor (docs/protocol.md, part 2): ``try_alloc(n)`` takes the smallest run that holds
``n`` pages whole (best fit), and only when none does, stitches the largest runs together::

    page id   0   1   2   3   4   5   6   7   8   9
    refcount  1   1   0   0   0   2   0   0   1   0
    free runs         [2, 3)          [6, 2)      [9, 1)     (start, length)

Invariants (``check_integrity``): a page is free iff its refcount is 0; free runs are disjoint
and never adjacent (freeing merges neighbours); the length index mirrors the runs.
"""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """A fixed set of KV pages with reference counts; never blocks, never raises on no-space."""

    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._num_free = 0
        self._run_len: dict[int, int] = {}  # start -> length of a free run
        self._run_start: dict[int, int] = {}  # end (exclusive) -> start of that run
        self._starts_by_len: dict[int, set[int]] = {}  # length -> starts of runs that long
        self._add_run(0, num_pages)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    @property
    def num_free_runs(self) -> int:
        return len(self._run_len)

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def try_alloc(self, num_pages: int) -> list[int] | None:
        """``num_pages`` pages with refcount 1, as few runs as possible; None when short."""
        assert num_pages >= 0
        if num_pages > self._num_free:
            return None
        fit = self._best_fit(num_pages)
        if fit is not None:
            return self._take(fit, num_pages)
        taken: list[int] = []
        while len(taken) < num_pages:
            start = self._largest_run()
            taken += self._take(start, min(self._run_len[start], num_pages - len(taken)))
        return taken

    def incref(self, page_ids: Iterable[int]) -> None:
        """Another owner for pages already in use (shared prefixes)."""
        for page_id in page_ids:
            assert self._refcount[page_id] > 0, f"page {page_id} is free"
            self._refcount[page_id] += 1

    def free(self, page_ids: Iterable[int]) -> None:
        """Drop one reference per page; a page whose count reaches 0 joins its neighbours."""
        start = end = -1  # the pending range [start, end) of pages that became free
        for page_id in page_ids:
            count = self._refcount[page_id]
            assert count > 0, f"page {page_id} freed twice"
            self._refcount[page_id] = count - 1
            if count > 1:
                continue
            if page_id != end:
                if end > start:
                    self._release(start, end)
                start = page_id
            end = page_id + 1
        if end > start:
            self._release(start, end)

    def check_integrity(self) -> None:
        seen = [False] * self.num_pages
        for start, length in self._run_len.items():
            assert length > 0 and self._run_start[start + length] == start
            assert start in self._starts_by_len[length]
            assert start + length not in self._run_len, "adjacent free runs were not merged"
            for page_id in range(start, start + length):
                assert not seen[page_id], f"page {page_id} in two free runs"
                seen[page_id] = True
        assert len(self._run_start) == len(self._run_len)
        assert sum(len(s) for s in self._starts_by_len.values()) == len(self._run_len)
        for page_id, count in enumerate(self._refcount):
            assert count >= 0 and (count == 0) == seen[page_id], f"page {page_id}: {count}"
        assert self._num_free == sum(seen)

    def _best_fit(self, num_pages: int) -> int | None:
        """Start of the shortest run of at least ``num_pages``; O(distinct run lengths)."""
        best = None
        for length in self._starts_by_len:
            if num_pages <= length and (best is None or length < best):
                best = length
        return None if best is None else min(self._starts_by_len[best])

    def _largest_run(self) -> int:
        return min(self._starts_by_len[max(self._starts_by_len)])

    def _take(self, start: int, num_pages: int) -> list[int]:
        """The first ``num_pages`` pages of the run at ``start``; the rest stays free."""
        length = self._remove_run(start)
        if length > num_pages:
            self._add_run(start + num_pages, length - num_pages)
        taken = list(range(start, start + num_pages))
        for page_id in taken:
            self._refcount[page_id] = 1
        return taken

    def _release(self, start: int, end: int) -> None:
        """Pages [start, end) became free: one run, merged with free neighbours."""
        left = self._run_start.get(start)
        if left is not None:
            self._remove_run(left)
            start = left
        if end in self._run_len:
            end += self._remove_run(end)
        self._add_run(start, end - start)

    def _add_run(self, start: int, length: int) -> None:
        self._run_len[start] = length
        self._run_start[start + length] = start
        self._starts_by_len.setdefault(length, set()).add(start)
        self._num_free += length

    def _remove_run(self, start: int) -> int:
        length = self._run_len.pop(start)
        del self._run_start[start + length]
        starts = self._starts_by_len[length]
        starts.discard(start)
        if not starts:
            del self._starts_by_len[length]
        self._num_free -= length
        return length
