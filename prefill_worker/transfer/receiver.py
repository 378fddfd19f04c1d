"""The decode SDK: ``KVReceiver``, what a decode engine embeds to receive KV from a worker.

It registers the decode's KV pool and aux rows with its own NIXL agent (progress thread off),
connects a DEALER to the worker's bootstrap server and ``register``s. Then per request::

    want(room, page_ids, aux_slot, num_cached_tokens)
    poll(room)  ->  PENDING | DONE | FAILED(reason) | ABORTED     (never blocks)
    read_aux(aux_slot)                                           (once DONE)
    forget(room)

DONE needs both the worker's ``status ok`` and the NIXL notification that follows the aux
row's write, so every byte has landed. ``poll`` also drives the agent, sends heartbeats and
fails every pending room when the worker is silent past ``peer_timeout_s``: call it (or
``progress()``) at least every ``heartbeat_interval_s``. After ``abort(room)`` wait for
ABORTED before reusing the pages: the worker acknowledges once no write targets them.

Recovery: when the worker says this connection is not registered (it dropped the peer, or
the connection was replaced), the receiver registers again by itself and repeats the wants
that were refused for it. A room still PENDING after ``room_timeout_s`` fails.

This module is the socket, the registration and the room rules; the room vocabulary and
record are ``decode_rooms``, a pool given as tensors is described by ``decode_pool``.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from prefill_worker.curve import CurveClientKeys, apply_client
from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxRow
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.decode_rooms import RoomEntry, RoomState, RoomStatus
from prefill_worker.transfer.nixl.agent import deregister_regions, make_agent, register_regions
from prefill_worker.transfer.nixl.sender import notif_tag


class RegistrationError(RuntimeError):
    """The worker refused this decode peer (the text says why) or never answered."""


class KVReceiver:
    """Decode-side endpoint of one worker's bootstrap server."""

    def __init__(
        self,
        regions: KVRegions,
        bootstrap_addr: str,
        *,
        agent_name: str | None = None,
        nixl_backends: Sequence[str] = ("UCX",),
        peer_timeout_s: float = 10.0,
        heartbeat_interval_s: float = 1.0,
        room_timeout_s: float = 60.0,
        curve: CurveClientKeys | None = None,
        ucx_net_devices: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.regions = regions
        self.agent_name = agent_name or f"decode-{uuid.uuid4().hex[:12]}"
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.room_timeout_s = room_timeout_s
        self._clock = clock
        self._agent = make_agent(self.agent_name, list(nixl_backends), ucx_net_devices)
        self._reg = register_regions(self._agent, regions)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No routing id of our own: ZMQ gives each connection a fresh one, which no other
        # connection can take over (the worker binds the registration to it).
        if curve is not None:
            apply_client(self._sock, curve)
        self._sock.connect(bootstrap_addr)
        self._rooms: dict[int, RoomEntry] = {}
        self._tags: dict[bytes, int] = {}  # notif_tag(room) -> room
        self._registration: RoomStatus = RoomStatus(RoomState.PENDING)
        self._is_worker_lost = False
        self._last_heard = clock()
        self._next_heartbeat = clock()
        self._owned: list[Any] = []  # buffers this receiver allocated (from_tensors)
        self._send(self._register_msg())

    @classmethod
    def from_tensors(
        cls,
        k_caches: Sequence[Any],
        v_caches: Sequence[Any],
        bootstrap_addr: str,
        *,
        num_aux_rows: int = 256,
        pool_layout: str = "layer_major",
        **kwargs: Any,
    ) -> KVReceiver:
        """From per-layer tensors [num_pages, page_size, num_kv_heads, head_dim], all on one
        device (CPU, or one CUDA device: the pool is registered as VRAM): contiguous for a
        ``layer_major`` pool, the views ``pool[:, l, 0]``/``pool[:, l, 1]`` of one
        ``[num_pages, L, 2, page_size, KV, D]`` tensor for ``page_major``. The receiver
        allocates its aux rows in host memory (pinned on CUDA), registered as DRAM."""
        from prefill_worker.transfer.decode_pool import regions_from_tensors

        regions, owned = regions_from_tensors(k_caches, v_caches, num_aux_rows, pool_layout)
        receiver = cls(regions, bootstrap_addr, **kwargs)
        receiver._owned = owned
        return receiver

    # -- registration -------------------------------------------------------------------

    @property
    def is_registered(self) -> bool:
        self.progress()
        return self._registration.state is RoomState.DONE

    def wait_registered(self, timeout_s: float) -> None:
        """Block until the worker accepts this peer; ``RegistrationError`` with its reason."""
        deadline = self._clock() + timeout_s
        while self._registration.state is RoomState.PENDING and self._clock() < deadline:
            self._sock.poll(10)
            self.progress()
        if self._registration.state is not RoomState.DONE:
            raise RegistrationError(self._registration.reason or "no answer from the worker")

    # -- per request --------------------------------------------------------------------

    def want(
        self, room: int, page_ids: Sequence[int], aux_slot: int, num_cached_tokens: int
    ) -> None:
        """Ask for the room's KV in ``page_ids`` (prompt pages from num_cached_tokens on).

        ``ValueError`` if the room is already wanted (``forget`` it first)."""
        if room in self._rooms:
            state = self._rooms[room].status.state.value
            raise ValueError(f"room {room} is already wanted ({state}); forget it first")
        want = wire.Want.of(room, [int(p) for p in page_ids], aux_slot, num_cached_tokens)
        self._rooms[room] = RoomEntry(
            RoomStatus(RoomState.PENDING), want, self._clock() + self.room_timeout_s
        )
        self._tags[notif_tag(room)] = room
        if self._is_worker_lost and self._registration.state is not RoomState.PENDING:
            self._reregister()  # silent or refused before (it may have restarted): ask again
        if self._registration.state is RoomState.FAILED:
            return self._end(room, RoomStatus(RoomState.FAILED, self._registration.reason))
        self._send(want)

    def poll(self, room: int) -> RoomStatus:
        self.progress()
        return self._entry(room).status

    def abort(self, room: int) -> None:
        """Ask the worker to stop; the room turns ABORTED once it acknowledges."""
        if self._entry(room).status.state is RoomState.PENDING:
            self._send(wire.Abort(room))

    def read_aux(self, aux_slot: int) -> AuxRow:
        """The aux row (first token, logprob) of a DONE room; host memory on any device."""
        if not 0 <= aux_slot < self.regions.num_aux_rows:
            raise ValueError(f"aux_slot {aux_slot} outside 0..{self.regions.num_aux_rows - 1}")
        raw = ctypes.string_at(self.regions.aux_base_addr + aux_slot * AUX_ROW_BYTES, AUX_ROW_BYTES)
        return AuxRow.unpack(raw)

    def forget(self, room: int) -> None:
        """Drop a finished room's status; ``ValueError`` while it is PENDING (abort it)."""
        if self._entry(room).status.state is RoomState.PENDING:
            raise ValueError(f"room {room} is pending: abort it and wait for ABORTED first")
        del self._rooms[room]
        self._tags.pop(notif_tag(room), None)

    def progress(self) -> None:
        """Drain the worker's messages and NIXL notifications, heartbeat, check liveness."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._last_heard = self._clock()
            try:
                self._on_message(wire.decode(frame))
            except wire.WireError:
                continue  # a newer worker's message we do not know: ignore, as the contract says
        for msgs in self._agent.get_new_notifs().values():
            for tag in msgs:
                self._on_landed(tag)
        now = self._clock()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval_s
            self._send(wire.Heartbeat())
        if now - self._last_heard > self.peer_timeout_s:
            self._on_worker_lost(f"prefill worker silent for over {self.peer_timeout_s:g} s")
        for room, entry in self._rooms.items():
            if entry.status.state is RoomState.PENDING and now >= entry.deadline:
                self._time_out(room, entry)

    def close(self) -> None:
        self._send(wire.Bye())
        self._sock.close(linger=0)
        self._ctx.term()
        deregister_regions(self._agent, self._reg)

    # -- internals ----------------------------------------------------------------------

    def _register_msg(self) -> wire.Register:
        metadata = wire.frame_metadata(self._agent.get_agent_metadata())
        compat = self.regions.layout.compat_hash()
        return wire.Register.of(self.agent_name, metadata, self.regions, compat)

    def _reregister(self) -> None:
        """Register again before this want; a refusal fails it (and the pending rooms)."""
        self._is_worker_lost = False
        self._registration = RoomStatus(RoomState.PENDING)
        self._last_heard = self._clock()
        self._send(self._register_msg())

    def _entry(self, room: int) -> RoomEntry:
        entry = self._rooms.get(room)
        if entry is None:
            raise KeyError(f"room {room} is not wanted by this receiver")
        return entry

    def _on_unknown(self) -> None:
        """The worker does not know this connection: register again (once at a time)."""
        if self._registration.state is RoomState.DONE:
            self._registration = RoomStatus(RoomState.PENDING)
            self._send(self._register_msg())

    def _resend_refused(self) -> None:
        for entry in self._rooms.values():
            if entry.is_resend_due and entry.status.state is RoomState.PENDING:
                entry.is_resend_due = False
                self._send(entry.want)

    def _send(self, msg: wire.Message) -> None:
        # A full queue means the worker is away; liveness fails what is pending.
        with contextlib.suppress(zmq.Again):
            self._sock.send(wire.encode(msg), zmq.NOBLOCK)

    def _on_message(self, msg: wire.Message) -> None:
        match msg:
            case wire.Registered(is_ok=True):
                self._registration = RoomStatus(RoomState.DONE)
                self._resend_refused()
            case wire.UnknownPeer():  # e.g. after a reconnect: the old connection's wants
                for entry in self._rooms.values():  # may be lost with it; repeat them all
                    entry.is_resend_due = not entry.is_status_ok
                self._on_unknown()
            case wire.Status(room=room, code="unknown_peer") if room in self._rooms:
                self._rooms[room].is_resend_due = True
                self._on_unknown()
            case wire.Registered(reason=reason):
                self._registration = RoomStatus(RoomState.FAILED, reason or "refused")
                self._on_worker_lost(f"registration refused: {reason}")
            case wire.Reject(reason=reason) if self._registration.state is RoomState.PENDING:
                self._registration = RoomStatus(RoomState.FAILED, reason)
            case wire.Status(room=room) if room in self._rooms:
                self._on_status(room, msg)

    def _time_out(self, room: int, entry: RoomEntry) -> None:
        """Abort the room and fail it once the worker acknowledges: until then a write may
        still target its pages (a lost worker fails it through liveness instead)."""
        if entry.timed_out_reason is None:
            entry.timed_out_reason = f"room {room} still pending after {self.room_timeout_s:g} s"
            self._send(wire.Abort(room))

    def _on_status(self, room: int, msg: wire.Status) -> None:
        entry = self._rooms[room]
        if entry.status.state is not RoomState.PENDING:
            return
        if msg.status == "ok":
            entry.is_status_ok = True
            if entry.is_landed:
                self._end(room, RoomStatus(RoomState.DONE))
        elif msg.status == "aborted" and entry.timed_out_reason is not None:
            self._end(room, RoomStatus(RoomState.FAILED, entry.timed_out_reason))
        elif msg.status == "aborted":
            self._end(room, RoomStatus(RoomState.ABORTED, msg.reason))
        else:
            self._end(room, RoomStatus(RoomState.FAILED, msg.reason or "failed"))

    def _on_landed(self, tag: bytes) -> None:
        room = self._tags.get(tag)
        if room is None:
            return
        entry = self._rooms[room]
        entry.is_landed = True
        if entry.is_status_ok and entry.status.state is RoomState.PENDING:
            self._end(room, RoomStatus(RoomState.DONE))

    def _end(self, room: int, status: RoomStatus) -> None:
        self._rooms[room].status = status

    def _on_worker_lost(self, reason: str) -> None:
        self._is_worker_lost = True
        if self._registration.state is RoomState.PENDING:
            self._registration = RoomStatus(RoomState.FAILED, reason)
        for room, entry in self._rooms.items():
            if entry.status.state is RoomState.PENDING:
                self._end(room, RoomStatus(RoomState.FAILED, reason))


__all__ = ["KVReceiver", "RegistrationError", "RoomState", "RoomStatus"]
