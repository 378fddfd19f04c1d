"""What the decode SDK keeps per wanted room: the states a room goes through, its record, and
the table of them that decides when a room ends.

``RoomState`` and ``RoomStatus`` are the SDK's public vocabulary (``KVReceiver.poll`` returns a
``RoomStatus``; import them from ``prefill_worker.transfer``). ``RoomTable`` holds the receiver's
rooms: what each asked for, what the worker and NIXL have said so far, and who waits for it.
A room ends once (DONE needs both the worker's ``status ok`` and the NIXL notification after
the aux row); ``on_end`` is called then, so waiters wake. Not thread-safe by itself: the
receiver calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefill_worker.transfer import wire


class RoomState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class RoomStatus:
    """A room's state. ``traceparent``: the W3C context of the worker's span for the request
    (when the worker traces), for the decode's own spans to continue that trace."""

    state: RoomState
    reason: str | None = None
    traceparent: str | None = None


@dataclass(slots=True)
class RoomEntry:
    status: RoomStatus
    want: wire.Want
    deadline: float  # PENDING past this fails
    is_status_ok: bool = False  # the worker said `status ok`
    is_landed: bool = False  # the aux row's NIXL notification arrived
    is_resend_due: bool = False  # sent before a register the worker needed: send again after
    timed_out_reason: str | None = None  # past the deadline: aborted, failing once acked
    traceparent: str | None = None  # the worker's span, from its status


class RoomTable:
    """The receiver's rooms by number, and NIXL notification tags back to rooms."""

    def __init__(self, on_end: Callable[[int, RoomStatus], None]) -> None:
        self._rooms: dict[int, RoomEntry] = {}
        self._tags: dict[bytes, int] = {}  # wire.notif_tag(room) -> room
        self._on_end = on_end

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def items(self) -> Iterator[tuple[int, RoomEntry]]:
        return iter(list(self._rooms.items()))

    def add(self, room: int, want: wire.Want, deadline: float, tag: bytes) -> None:
        self._rooms[room] = RoomEntry(RoomStatus(RoomState.PENDING), want, deadline)
        self._tags[tag] = room

    def entry(self, room: int) -> RoomEntry:
        entry = self._rooms.get(room)
        if entry is None:
            raise KeyError(f"room {room} is not wanted by this receiver")
        return entry

    def forget(self, room: int, tag: bytes) -> None:
        del self._rooms[room]
        self._tags.pop(tag, None)

    def end(self, room: int, status: RoomStatus) -> None:
        """The room's one outcome (ignored once it has one)."""
        entry = self._rooms[room]
        if entry.status.state is RoomState.PENDING:
            if entry.traceparent is not None:
                status = dataclasses.replace(status, traceparent=entry.traceparent)
            entry.status = status
            self._on_end(room, status)

    def on_status(self, room: int, msg: wire.Status) -> None:
        entry = self._rooms[room]
        if entry.status.state is not RoomState.PENDING:
            return
        if isinstance(msg.traceparent, str):
            entry.traceparent = msg.traceparent
        if msg.status == "ok":
            entry.is_status_ok = True
            if entry.is_landed:
                self.end(room, RoomStatus(RoomState.DONE))
        elif msg.status == "aborted" and entry.timed_out_reason is not None:
            self.end(room, RoomStatus(RoomState.FAILED, entry.timed_out_reason))
        elif msg.status == "aborted":
            self.end(room, RoomStatus(RoomState.ABORTED, msg.reason))
        else:
            self.end(room, RoomStatus(RoomState.FAILED, msg.reason or "failed"))

    def on_landed(self, tag: bytes) -> None:
        room = self._tags.get(tag)
        if room is None:
            return
        entry = self._rooms[room]
        entry.is_landed = True
        if entry.is_status_ok:
            self.end(room, RoomStatus(RoomState.DONE))

    def fail_pending(self, reason: str) -> None:
        for room, entry in self.items():
            if entry.status.state is RoomState.PENDING:
                self.end(room, RoomStatus(RoomState.FAILED, reason))

    @property
    def has_pending(self) -> bool:
        return any(e.status.state is RoomState.PENDING for e in self._rooms.values())
