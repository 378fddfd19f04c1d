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
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxRow
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.agent import make_agent, register_regions
from prefill_worker.transfer.nixl_sender import notif_tag


class RoomState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class RoomStatus:
    state: RoomState
    reason: str | None = None


class RegistrationError(RuntimeError):
    """The worker refused this decode peer (the text says why) or never answered."""


@dataclass(slots=True)
class _Room:
    status: RoomStatus
    is_status_ok: bool = False  # the worker said `status ok`
    is_landed: bool = False  # the aux row's NIXL notification arrived


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.regions = regions
        self.agent_name = agent_name or f"decode-{uuid.uuid4().hex[:12]}"
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._clock = clock
        self._agent = make_agent(self.agent_name, list(nixl_backends))
        self._reg = register_regions(self._agent, regions)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A stable routing id: after a reconnect the worker still knows who this is.
        self._sock.setsockopt(zmq.ROUTING_ID, self.agent_name.encode()[:255])
        self._sock.connect(bootstrap_addr)
        self._rooms: dict[int, _Room] = {}
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
        **kwargs: Any,
    ) -> KVReceiver:
        """From per-layer CPU tensors [num_pages, page_size, num_kv_heads, head_dim]; the
        receiver allocates its aux rows."""
        from prefill_worker.kv.aux import AuxPool
        from prefill_worker.kv.layout import KVLayout

        k0 = k_caches[0]
        assert k0.device.type == "cpu", "from_tensors takes CPU tensors; pass KVRegions for CUDA"
        num_pages, page_size, num_kv_heads, head_dim = k0.shape
        dtype = str(k0.dtype).removeprefix("torch.")
        layout = KVLayout(len(k_caches), num_kv_heads, head_dim, dtype, page_size, num_pages)
        aux = AuxPool(num_aux_rows)
        regions = KVRegions(
            layout,
            tuple(int(t.data_ptr()) for t in k_caches),
            tuple(int(t.data_ptr()) for t in v_caches),
            "cpu",
            aux.base_addr,
            num_aux_rows,
        )
        receiver = cls(regions, bootstrap_addr, **kwargs)
        receiver._owned = [aux, *k_caches, *v_caches]
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
        """Ask for the room's KV in ``page_ids`` (prompt pages from num_cached_tokens on)."""
        assert room not in self._rooms, f"room {room} is already wanted"
        self._rooms[room] = _Room(RoomStatus(RoomState.PENDING))
        self._tags[notif_tag(room)] = room
        if self._is_worker_lost and self._registration.state is RoomState.DONE:
            self._reregister()
        if self._registration.state is RoomState.FAILED:
            return self._end(room, RoomStatus(RoomState.FAILED, self._registration.reason))
        self._send(wire.Want(room, tuple(int(p) for p in page_ids), aux_slot, num_cached_tokens))

    def poll(self, room: int) -> RoomStatus:
        self.progress()
        return self._rooms[room].status

    def abort(self, room: int) -> None:
        """Ask the worker to stop; the room turns ABORTED once it acknowledges."""
        if self._rooms[room].status.state is RoomState.PENDING:
            self._send(wire.Abort(room))

    def read_aux(self, aux_slot: int) -> AuxRow:
        assert self.regions.device == "cpu" and 0 <= aux_slot < self.regions.num_aux_rows
        raw = ctypes.string_at(self.regions.aux_base_addr + aux_slot * AUX_ROW_BYTES, AUX_ROW_BYTES)
        return AuxRow.unpack(raw)

    def forget(self, room: int) -> None:
        """Drop a finished room's status."""
        assert self._rooms[room].status.state is not RoomState.PENDING, "forget a pending room"
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

    def close(self) -> None:
        self._send(wire.Bye())
        self._sock.close(linger=0)
        self._ctx.term()
        self._agent.deregister_memory(self._reg)

    # -- internals ----------------------------------------------------------------------

    def _register_msg(self) -> wire.Register:
        metadata = wire.frame_metadata(self._agent.get_agent_metadata())
        compat = self.regions.layout.compat_hash()
        return wire.Register(self.agent_name, metadata, self.regions, compat)

    def _reregister(self) -> None:
        """The worker was silent (it may have restarted): register again before this want."""
        self._is_worker_lost = False
        self._registration = RoomStatus(RoomState.PENDING)
        self._last_heard = self._clock()
        self._send(self._register_msg())

    def _send(self, msg: wire.Message) -> None:
        # A full queue means the worker is away; liveness fails what is pending.
        with contextlib.suppress(zmq.Again):
            self._sock.send(wire.encode(msg), zmq.NOBLOCK)

    def _on_message(self, msg: wire.Message) -> None:
        match msg:
            case wire.Registered(is_ok=True):
                self._registration = RoomStatus(RoomState.DONE)
            case wire.Registered(reason=reason):
                self._registration = RoomStatus(RoomState.FAILED, reason or "refused")
                self._on_worker_lost(f"registration refused: {reason}")
            case wire.Reject(reason=reason) if self._registration.state is RoomState.PENDING:
                self._registration = RoomStatus(RoomState.FAILED, reason)
            case wire.Status(room=room) if room in self._rooms:
                self._on_status(room, msg)

    def _on_status(self, room: int, msg: wire.Status) -> None:
        entry = self._rooms[room]
        if entry.status.state is not RoomState.PENDING:
            return
        if msg.status == "ok":
            entry.is_status_ok = True
            if entry.is_landed:
                self._end(room, RoomStatus(RoomState.DONE))
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
