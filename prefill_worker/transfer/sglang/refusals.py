"""Rooms whose decode was refused before the room's request came: the decode sent a transfer
request, but its registration was refused (or it never registered with this run of the
worker, as after a restart). The decode has its ``KV_STATUS failed``; the request that comes
later for the room fails at once with the same reason instead of waiting out its bootstrap
timeout (a router would wait for it and then hear only "no handshake").

Bounded: at most ``max_rooms`` (the oldest forgotten first), each for ``keep_s``: a frame
costs an unregistered sender nothing, so what it leaves here must be capped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RefusedRoom:
    agent_name: str  # the decode that asked for it
    reason: str
    forget_at: float


class RefusedRooms:
    def __init__(self, keep_s: float, max_rooms: int = 1024) -> None:
        self._keep_s, self._max_rooms = keep_s, max_rooms
        self._rooms: OrderedDict[int, RefusedRoom] = OrderedDict()

    def add(self, room: int, agent_name: str, reason: str, now: float) -> None:
        self._rooms[room] = RefusedRoom(agent_name, reason, now + self._keep_s)
        self._rooms.move_to_end(room)
        while len(self._rooms) > self._max_rooms:
            self._rooms.popitem(last=False)

    def take(self, room: int, now: float) -> RefusedRoom | None:
        """The room's refusal, once; None when there is none (or it is past ``keep_s``)."""
        refused = self._rooms.pop(room, None)
        return refused if refused is not None and now < refused.forget_at else None

    def __len__(self) -> int:
        return len(self._rooms)
