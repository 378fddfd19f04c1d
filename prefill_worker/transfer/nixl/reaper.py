"""Write handles NIXL would not release when their sender closed: retried, then given up.

A closed sender hands its stuck handles to the backend (``Closed.stuck``); each gets a
deadline. ``reap`` retries every one on each poll; past its deadline, disconnecting its peer
(which ends its writes) is the last resort, as it is for a peer that goes silent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prefill_worker.transfer.nixl.sender import release

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stuck:
    """A write handle NIXL would not release when its sender closed."""

    handle: Any
    request_id: str
    peer_identity: bytes | None
    deadline: float


class HandleReaper:
    """Holds stuck write handles until NIXL releases them or their peer is dropped."""

    def __init__(self) -> None:
        self._stuck: list[_Stuck] = []

    def __len__(self) -> int:
        return len(self._stuck)

    def add(
        self, handles: Iterable[Any], request_id: str, peer_identity: bytes | None, deadline: float
    ) -> None:
        self._stuck += [_Stuck(h, request_id, peer_identity, deadline) for h in handles]

    def reap(self, now: float, drop_peer: Callable[[bytes | None], None]) -> None:
        """Retry every handle; one past its deadline has its peer dropped (``drop_peer``),
        then one last release."""
        for stuck in list(self._stuck):
            if release(stuck.handle, stuck.request_id):
                self._stuck.remove(stuck)
            elif now >= stuck.deadline:
                self._stuck.remove(stuck)
                drop_peer(stuck.peer_identity)
                if not release(stuck.handle, stuck.request_id):
                    log.error("request %s: a write handle is leaked to NIXL", stuck.request_id)
