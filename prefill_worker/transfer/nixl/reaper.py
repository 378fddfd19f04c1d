"""What waits for writes to settle: writes a closed sender released (retried, then given up),
and statuses that may go out only once their room's writes can no longer land.

A closed sender hands its unsettled writes to its hub (``Closed.stuck``): their release
is under way on the transfer thread, or NIXL refused it. Each gets a deadline. ``reap``
retries every one on each poll (``Write.release`` is idempotent) and forgets it once
settled; one NIXL still refuses past its deadline has its peer disconnected (which ends its
writes), the last resort, as for a peer that goes silent. A release that is only slow (the
transfer thread is finishing a copy) is waited for.

``HeldTells`` keeps a status for a decode (``push.dialect.Tell``) whose
``after`` writes are not settled (a ``failed`` while the room's last chunk is still being
copied, say) and lets it out, in order, once they are, or past a deadline (NIXL refusing to
release a write must not silence a peer forever).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from prefill_worker.transfer.nixl.poster import Write

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stuck:
    """A write released by its closed sender, not settled yet."""

    write: Write
    request_id: str
    peer_identity: bytes | None
    deadline: float


class HandleReaper:
    """Holds unsettled writes until they settle or their peer is dropped."""

    def __init__(self) -> None:
        self._stuck: list[_Stuck] = []

    def __len__(self) -> int:
        return len(self._stuck)

    def add(
        self, writes: Iterable[Write], request_id: str, peer_identity: bytes | None, deadline: float
    ) -> None:
        self._stuck += [_Stuck(w, request_id, peer_identity, deadline) for w in writes]

    def reap(self, now: float, drop_peer: Callable[[bytes | None], None]) -> None:
        """Retry every write; one NIXL still refuses past its deadline has its peer dropped
        (``drop_peer``), then one last release."""
        for stuck in list(self._stuck):
            stuck.write.release()
            if stuck.write.is_settled:
                self._stuck.remove(stuck)
            elif now >= stuck.deadline and stuck.write.is_refused:
                self._stuck.remove(stuck)
                drop_peer(stuck.peer_identity)
                stuck.write.release()
                log.error("request %s: NIXL refused to release a write", stuck.request_id)


class _AfterWrites(Protocol):
    @property
    def after(self) -> tuple[Write, ...]: ...


T = TypeVar("T", bound=_AfterWrites)


class HeldTells(Generic[T]):
    """Messages waiting for their writes to settle, in the order they were told."""

    def __init__(self, max_hold_s: float) -> None:
        self._max_hold_s = max_hold_s
        self._held: list[tuple[T, float]] = []  # (message, send anyway at)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, tell: T, now: float) -> None:
        self._held.append((tell, now + self._max_hold_s))

    def take_ready(self, now: float) -> list[T]:
        """The held messages that may go out now: settled, or held too long (logged)."""
        ready: list[T] = []
        kept: list[tuple[T, float]] = []
        for tell, until in self._held:
            if all(w.is_settled for w in tell.after):
                ready.append(tell)
            elif now >= until:
                log.warning("a status goes out before its writes settled (%gs)", self._max_hold_s)
                ready.append(tell)
            else:
                kept.append((tell, until))
        self._held = kept
        return ready
