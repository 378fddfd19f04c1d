"""Refusals: counted (``RejectCounter``) and remembered for a while (``ExpiringTable``).

A refused decode often cannot be told why when it matters: a native decode whose registration
is refused never sends a ``want``; an SGLang decode has no answer to its registration and
learns why on its first request. So both protocols keep refusals in one kind of table, by
agent name or by room, so the room's request fails at once with the reason instead of
waiting out its bootstrap timeout (a router would then hear only "no handshake"). What a
peer can leave here is bounded: the newest ``max_items``, each for ``keep_s``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prefill_worker.transfer.validate import RejectReason

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 64  # a refused name, as a summary shows it: a peer chooses names

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiringTable(Generic[K, V]):
    """The newest ``max_items`` entries, each live for ``keep_s`` after it was added."""

    def __init__(self, keep_s: float, max_items: int) -> None:
        self._keep_s, self._max_items = keep_s, max_items
        self._items: OrderedDict[K, tuple[V, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: K, value: V, now: float) -> None:
        self._items.pop(key, None)
        self._items[key] = (value, now + self._keep_s)
        while len(self._items) > self._max_items:
            self._items.popitem(last=False)

    def get(self, key: K, now: float) -> V | None:
        value, forget_at = self._items.get(key, (None, now))
        return value if now < forget_at else None

    def take(self, key: K, now: float) -> V | None:
        """The entry, once; None when there is none (or it is past ``keep_s``)."""
        value, forget_at = self._items.pop(key, (None, now))
        return value if now < forget_at else None

    def clear(self, key: K) -> None:
        self._items.pop(key, None)

    def live(self, now: float) -> list[tuple[K, V]]:
        """The live entries, newest first."""
        return [(k, v) for k, (v, until) in reversed(self._items.items()) if now < until]


@dataclass(frozen=True, slots=True)
class RefusedRoom:
    agent_name: str  # the decode that asked for the room
    reason: str


@dataclass(frozen=True, slots=True)
class Refusals:
    """What a room's request hears when it comes: its named decode's registration was
    refused (``names``, native), or its decode asked for it and was refused (``rooms``)."""

    names: ExpiringTable[str, str]
    rooms: ExpiringTable[int, RefusedRoom]


def summary(refused: ExpiringTable[str, str], now: float) -> str | None:
    """``"registrations refused lately: a (why); b (why)"``, or None when there were none."""
    live = [f"{name[:MAX_NAME_CHARS]!r} ({why})" for name, why in refused.live(now)]
    return "registrations refused lately: " + "; ".join(live) if live else None


class RejectCounter:
    """Counts every refusal by reason (``counts``; ``on_reject`` for metrics) and logs it."""

    def __init__(self, protocol: str, on_reject: Callable[[str], None] | None = None) -> None:
        self.protocol = protocol  # the log prefix: "bootstrap" (native) or "sglang"
        self._on_reject = on_reject or (lambda reason: None)
        self.counts: dict[str, int] = {}

    def count(self, reason: RejectReason, message: str, level: int = logging.WARNING) -> None:
        self.counts[reason.value] = self.counts.get(reason.value, 0) + 1
        self._on_reject(reason.value)
        log.log(level, "%s: %s: %s", self.protocol, reason.value, message)
