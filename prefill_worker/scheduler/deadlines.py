"""Deadlines in one heap, so a turn looks only at the ones that expired: O(log n) each.

Entries are never removed early: when one expires, the engine checks that it still applies
(the request is still in the state the deadline guards) and ignores it otherwise.
"""

from __future__ import annotations

import enum
import heapq
import itertools

from prefill_worker.scheduler.tracked import Request


class DeadlineKind(enum.Enum):
    BOOTSTRAP = "bootstrap"  # until the decode's want: bootstrap_timeout_s after arrival
    HOLD = "hold"  # while a finished optimistic prefill waits for its want: optimistic_hold_s
    TRANSFER = "transfer"  # while TRANSFERRING: transfer_timeout_s after the last chunk
    REQUEST = "request"  # any live state: the request's own deadline_s after arrival


class DeadlineHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, DeadlineKind, Request]] = []
        self._seq = itertools.count()  # ties never compare requests

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: float, kind: DeadlineKind, req: Request) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, req))

    def next_at(self) -> float | None:
        """When the earliest deadline passes (it may no longer apply), if any is held."""
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> list[tuple[DeadlineKind, Request]]:
        expired = []
        while self._heap and self._heap[0][0] <= now:
            _, _, kind, req = heapq.heappop(self._heap)
            expired.append((kind, req))
        return expired
