"""The decode SDK's conversation with one worker: the DEALER socket, the registration, and
what each worker message means for the rooms.

``WorkerLink`` registers, heartbeats, notices a silent worker (every pending room fails),
registers again when the worker no longer knows this connection (and repeats the wants sent
before that register, never one sent after it), and turns ``status`` messages into room
outcomes in the ``RoomTable``. Not thread-safe by itself: ``KVReceiver`` calls it under its lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import msgspec
import zmq

from prefill_worker.curve import CurveClientKeys, apply_client
from prefill_worker.transfer import wire
from prefill_worker.transfer.decode.rooms import RoomState, RoomStatus, RoomTable


class WorkerLink:
    """One DEALER to a worker's bootstrap server and the registration on it."""

    def __init__(
        self,
        bootstrap_addr: str,
        register_msg: Callable[[], wire.Register],
        rooms: RoomTable,
        on_registration: Callable[[], None],
        clock: Callable[[], float],
        *,
        heartbeat_interval_s: float,
        peer_timeout_s: float,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self._register_msg, self._rooms = register_msg, rooms
        self._on_registration, self._clock = on_registration, clock
        self.heartbeat_interval_s, self.peer_timeout_s = heartbeat_interval_s, peer_timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No routing id of our own: ZMQ gives each connection a fresh one, which no other
        # connection can take over (the worker binds the registration to it).
        if curve is not None:
            apply_client(self._sock, curve)
        self._sock.connect(bootstrap_addr)
        self.registration = RoomStatus(RoomState.PENDING)
        self.worker_tp: wire.WorkerTP | None = None  # from `registered`, when it names it
        self._is_worker_lost = False
        self._last_heard = self._next_heartbeat = clock()
        self.send(register_msg())

    def send(self, msg: wire.Message) -> None:
        # A full queue means the worker is away; liveness fails what is pending.
        with contextlib.suppress(zmq.Again):
            self._sock.send(wire.encode(msg), zmq.NOBLOCK)

    def send_want(self, room: int, want: wire.Want) -> None:
        """A new room's want: registers again first if the worker was lost (it may have
        restarted); a refused registration fails the room at once."""
        if self._is_worker_lost and self.registration.state is not RoomState.PENDING:
            self._is_worker_lost = False
            self._set_registration(RoomStatus(RoomState.PENDING))
            self._last_heard = self._clock()
            self.send(self._register_msg())
        if self.registration.state is RoomState.FAILED:
            self._rooms.end(room, RoomStatus(RoomState.FAILED, self.registration.reason))
        else:
            self.send(want)

    def drain(self) -> None:
        """Every message that has arrived, handled."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = self._clock()
            try:
                self._on_message(wire.decode(frame))
            except wire.WireError:
                continue  # a newer worker's message we do not know: ignore, as the contract says

    def tick(self, now: float) -> None:
        """Heartbeat when due; a worker silent past ``peer_timeout_s`` is lost."""
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval_s
            self.send(wire.Heartbeat())
        if now - self._last_heard > self.peer_timeout_s:
            self._on_worker_lost(f"prefill worker silent for over {self.peer_timeout_s:g} s")

    def time_out(self, room: int, room_timeout_s: float) -> None:
        """Abort the room and fail it once the worker acknowledges: until then a write may
        still target its pages (a lost worker fails it through liveness instead)."""
        entry = self._rooms.entry(room)
        if entry.timed_out_reason is None:
            entry.timed_out_reason = f"room {room} still pending after {room_timeout_s:g} s"
            self.send(wire.Abort(room))

    def close(self) -> None:
        self.send(wire.Bye())
        self._sock.close(linger=0)
        self._ctx.term()

    def _on_message(self, msg: wire.Message) -> None:
        match msg:
            case wire.Registered(is_ok=True, tp=tp):
                self.worker_tp = None if isinstance(tp, msgspec.UnsetType) else tp
                self._set_registration(RoomStatus(RoomState.DONE))
                self._resend_refused()
            case wire.UnknownPeer():
                self._on_unknown()
            case wire.Status(room=room, code="unknown_peer") if room in self._rooms:
                self._rooms.entry(room).is_resend_due = True
                self._on_unknown()
            case wire.Registered(reason=reason):
                self._set_registration(RoomStatus(RoomState.FAILED, reason or "refused"))
                self._on_worker_lost(f"registration refused: {reason}")
            case wire.Reject(reason=reason) if self.registration.state is RoomState.PENDING:
                self._set_registration(RoomStatus(RoomState.FAILED, reason))
            case wire.Status(room=room) if room in self._rooms:
                self._rooms.on_status(room, msg)

    def _on_unknown(self) -> None:
        """The worker does not know this connection: register again (once at a time) and,
        once accepted, repeat every want sent before (after a reconnect the old connection's
        wants may be lost with it). The worker answers a connection in order, so while that
        register is pending, `unknown` answers a message sent before it: wants sent since
        reach the new registration and are not repeated (the worker would refuse the repeat
        as a duplicate want, failing a room it holds)."""
        if self.registration.state is RoomState.DONE:
            for _, entry in self._rooms.items():
                entry.is_resend_due = not entry.is_status_ok
            self._set_registration(RoomStatus(RoomState.PENDING))
            self.send(self._register_msg())

    def _resend_refused(self) -> None:
        for _, entry in self._rooms.items():
            if entry.is_resend_due and entry.status.state is RoomState.PENDING:
                entry.is_resend_due = False
                self.send(entry.want)

    def _set_registration(self, status: RoomStatus) -> None:
        self.registration = status
        self._on_registration()

    def _on_worker_lost(self, reason: str) -> None:
        self._is_worker_lost = True
        if self.registration.state is RoomState.PENDING:
            self._set_registration(RoomStatus(RoomState.FAILED, reason))
        self._rooms.fail_pending(reason)
