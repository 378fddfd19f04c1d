"""Which rooms belong to vLLM decodes, and the ``kv_transfer_params`` each one ends with:
the one object the HTTP front and the vLLM backend share.

A vLLM proxy asks this worker for a prefill with ``kv_transfer_params.do_remote_decode``; the
decode then pulls what the prefill staged. No decode claims a room here (as native and SGLang
decodes do): the request itself is the claim. So the HTTP front opens a ticket for the room
before the request enters the engine; the vLLM backend's sender for that room is READY at once
(one with no ticket waits, as for a decode that never came, and loses the room to another
protocol's decode); once the KV is staged and held, the sender completes the ticket with the
params; the front takes them when the request's outcome arrives::

    HTTP thread           open(room) ─▶ inbox            take(room) ─▶ the answer's params
    engine thread                     is_open(room)   complete(room, params)

Thread-safe (one lock; every call is a dict operation). Bounded: at most ``max_open`` tickets
(the front's in-flight cap), ``open`` refuses beyond it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

Params = Mapping[str, Any]


class Tickets:
    """Rooms opened for vLLM pulls, and their params once staged."""

    def __init__(self, max_open: int) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[int, Params | None] = {}
        self._max_open = max_open

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def open(self, room: int) -> bool:
        """Mark ``room`` as a vLLM pull; False when ``max_open`` are open already, or this
        room is (a room is one request's)."""
        with self._lock:
            if len(self._rooms) >= self._max_open or room in self._rooms:
                return False
            self._rooms[room] = None
            return True

    def is_open(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def complete(self, room: int, params: Params) -> bool:
        """Record the params for ``room``; False if its ticket was taken (the front gave up)."""
        with self._lock:
            if room not in self._rooms:
                return False
            self._rooms[room] = params
            return True

    def take(self, room: int) -> Params | None:
        """Close ``room``'s ticket; its params, or None if none were recorded."""
        with self._lock:
            return self._rooms.pop(room, None)
