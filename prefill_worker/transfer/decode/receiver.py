"""``KVReceiver``: what a decode engine embeds to receive KV from a worker.

It registers the decode's KV pool and aux rows with its own NIXL agent (progress thread off),
connects to the worker's bootstrap server and ``register``s. Then per request::

    want(room, page_ids, aux_slot, num_cached_tokens[, state_slot])
    poll(room)  ->  PENDING | DONE | FAILED(reason) | ABORTED     (never blocks)
    wait(room, timeout_s) / await wait_async(room)               (blocks / suspends)
    read_aux(aux_slot)                                           (once DONE)
    forget(room)

DONE needs both the worker's ``status ok`` and the NIXL notification after the aux row.

A hybrid model's decode also gives its state pool (``state``: ``StateRegions``, from
``transfer.state_regions_from_tensors`` over the component ``describe_state`` names), on the
KV pool's device; each ``want`` then names the ``state_slot`` the room's state (the linear
layers' conv and recurrent state after the whole prompt) lands in, before the aux row.
A DSA model's (``index_keys``, copied as ``pages``) is a pool of as many pages as the KV
pool: its wants name no ``state_slot``, the index keys land in the room's own page ids.

A decode of tensor-parallel size d > 1 runs one receiver per rank (``tp=(rank, d,
num_kv_heads)``), each over its rank's pool of its KV heads (``kv.heads``), each wanting every
room with its own pages; the worker writes each rank its heads and tells each rank the
outcome. ``worker_tp`` is the worker's TP layout, as its `registered` names it.
Threads, recovery and caller errors: docs/protocol.md, "Write a decode integration". This
module holds the public surface, the agent and the lock; the worker conversation is ``link``,
rooms ``rooms``, tensors ``pool``, waiting ``io``.
"""

from __future__ import annotations

import ctypes
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from prefill_worker.batch import DraftRow
from prefill_worker.curve import CurveClientKeys
from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxRow
from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import KVRegions
from prefill_worker.kv.state_layout import PAGES, StateRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.decode.draft import check_draft, draft_pool, register_draft
from prefill_worker.transfer.decode.io import IOThread, Waiters
from prefill_worker.transfer.decode.link import WorkerLink
from prefill_worker.transfer.decode.rooms import RoomState, RoomStatus, RoomTable
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.nixl.agent import deregister_regions, make_agent, register_regions
from prefill_worker.transfer.nixl.state_lists import register_state


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
        io_thread: bool = False,
        tp: tuple[int, int, int] | None = None,
        state: StateRegions | None = None,
        draft: DraftSide | None = None,
    ) -> None:
        """``tp``: (this rank, the decode's TP size, the model's KV heads) for a decode of
        TP > 1; the pool must hold exactly this rank's heads (``ValueError`` otherwise).
        ``state``: a hybrid model's state pool, on the KV pool's device. ``draft``: a
        speculating decode's draft pool and rows (``decode.draft``; ``read_draft``)."""
        if draft is not None:
            check_draft(draft, regions)
        if state is not None and state.device != regions.device:
            raise ValueError(
                f"the state pool is on {state.device}, the KV pool on {regions.device}"
            )
        self.regions, self.state = regions, state
        self._rank = None if tp is None else _decode_rank(regions, *tp)
        self.agent_name = agent_name or f"decode-{uuid.uuid4().hex[:12]}"
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.room_timeout_s = room_timeout_s
        self._clock = clock
        self._lock = threading.RLock()
        self._waiters = Waiters(self._lock)
        self._rooms = RoomTable(self._waiters.ended)
        self._agent = make_agent(self.agent_name, list(nixl_backends), ucx_net_devices)
        self._reg = register_regions(self._agent, regions)
        self._state_reg = None if state is None else register_state(self._agent, state)
        self.draft = draft
        self._draft_regs = [] if draft is None else register_draft(self._agent, draft)
        self._link = WorkerLink(
            bootstrap_addr,
            self._register_msg,
            self._rooms,
            self._waiters.changed,
            clock,
            heartbeat_interval_s=heartbeat_interval_s,
            peer_timeout_s=peer_timeout_s,
            curve=curve,
        )
        self._is_closed = False
        self._owned: list[Any] = []  # buffers this receiver allocated (from_tensors)
        self._io = IOThread(self._io_turn, f"kv-receiver-{self.agent_name}") if io_thread else None

    @classmethod
    def from_tensors(
        cls,
        k_caches: Sequence[Any],
        v_caches: Sequence[Any],
        bootstrap_addr: str,
        *,
        num_aux_rows: int = 256,
        pool_layout: str | None = None,
        **kwargs: Any,
    ) -> KVReceiver:
        """From per-layer tensors [num_pages, page_size, num_kv_heads, head_dim], all on one
        device (CPU, or one CUDA device: the pool is registered as VRAM): contiguous for a
        ``layer_major`` pool, the views ``pool[:, l, 0]``/``pool[:, l, 1]`` of one
        ``[num_pages, L, 2, page_size, KV, D]`` tensor for ``page_major``; for an MLA
        model's ``mla`` pool, one contiguous latent tensor ``[num_pages, page_size, 1,
        kv_lora_rank + qk_rope_head_dim]`` per layer in ``k_caches`` and ``v_caches`` empty
        (unset, ``pool_layout`` is read from their page stride, or no V). The receiver
        allocates its aux rows in host memory (pinned on CUDA), registered as DRAM.
        ``ValueError`` with the reason when the tensors are not one such pool."""
        from prefill_worker.transfer.decode.pool import regions_from_tensors

        regions, owned = regions_from_tensors(k_caches, v_caches, num_aux_rows, pool_layout)
        receiver = cls(regions, bootstrap_addr, **kwargs)
        receiver._owned = owned
        return receiver

    # -- registration -------------------------------------------------------------------

    @property
    def worker_tp(self) -> wire.WorkerTP | None:
        """The worker's TP layout (tp_size, each rank's heads and endpoint), once registered
        with ``tp`` given; None before, or from a worker that predates it."""
        with self._lock:
            return self._link.worker_tp

    @property
    def is_registered(self) -> bool:
        with self._lock:
            self._progress_if_alone()
            return self._link.registration.state is RoomState.DONE

    def wait_registered(self, timeout_s: float) -> None:
        """Block until the worker accepts this peer; ``RegistrationError`` with its reason."""
        with self._lock:
            is_answered = self._waiters.wait(
                lambda: self._link.registration.state is not RoomState.PENDING,
                timeout_s,
                self._driver(),
            )
            registration = self._link.registration
            if not is_answered or registration.state is not RoomState.DONE:
                raise RegistrationError(registration.reason or "no answer from the worker")

    # -- per request --------------------------------------------------------------------

    def want(
        self,
        room: int,
        page_ids: Sequence[int],
        aux_slot: int,
        num_cached_tokens: int,
        state_slot: int | None = None,
    ) -> None:
        """Ask for the room's KV in ``page_ids`` (prompt pages from num_cached_tokens on; how
        many: ``transfer.num_want_pages``) and, with a state pool, its state in
        ``state_slot``. ``ValueError`` if the room is already wanted (``forget`` it first),
        a page or a slot is outside its pool, or a state slot is missing or has no pool."""
        ids = [int(p) for p in page_ids]
        num_pages = self.regions.layout.num_pages
        if any(not 0 <= p < num_pages for p in ids):
            raise ValueError(f"room {room}: page ids must be in [0, {num_pages})")
        self._check_slot(aux_slot)
        self._check_state_slot(room, state_slot)
        with self._lock:
            if room in self._rooms:
                state = self._rooms.entry(room).status.state.value
                raise ValueError(f"room {room} is already wanted ({state}); forget it first")
            dst_state = msgspec.UNSET if state_slot is None else state_slot
            want = wire.Want.of(room, ids, aux_slot, num_cached_tokens, dst_state)
            self._rooms.add(room, want, self._clock() + self.room_timeout_s, wire.notif_tag(room))
            self._link.send_want(room, want)
        if self._io is not None:
            self._io.kick()  # a room is pending: its progress polls NIXL often now

    def poll(self, room: int) -> RoomStatus:
        """The room's status now; never blocks (drives progress unless an I/O thread does)."""
        with self._lock:
            self._progress_if_alone()
            return self._rooms.entry(room).status

    def wait(self, room: int, timeout_s: float) -> RoomStatus:
        """Block until the room is no longer PENDING; its status. ``TimeoutError`` (the room
        still wanted: abort or wait again) after ``timeout_s``."""
        with self._lock:
            entry = self._rooms.entry(room)
            is_ended = self._waiters.wait(
                lambda: entry.status.state is not RoomState.PENDING, timeout_s, self._driver()
            )
            if not is_ended:
                raise TimeoutError(f"room {room} still pending after {timeout_s:g} s")
            return entry.status

    async def wait_async(self, room: int, timeout_s: float | None = None) -> RoomStatus:
        """``await`` until the room is no longer PENDING (asyncio). ``TimeoutError`` after
        ``timeout_s``. Without an I/O thread it drives progress itself while it waits."""
        with self._lock:
            status = self._rooms.entry(room).status
            if status.state is not RoomState.PENDING:
                return status
            future = self._waiters.future_for(room)
        return await self._waiters.wait_future(future, room, timeout_s, self._driver())

    def abort(self, room: int) -> None:
        """Ask the worker to stop; the room turns ABORTED once it acknowledges."""
        with self._lock:
            if self._rooms.entry(room).status.state is RoomState.PENDING:
                self._link.send(wire.Abort(room))

    def read_aux(self, aux_slot: int) -> AuxRow:
        """The aux row (first token, logprob) of a DONE room; host memory on any device."""
        self._check_slot(aux_slot)
        raw = ctypes.string_at(self.regions.aux_base_addr + aux_slot * AUX_ROW_BYTES, AUX_ROW_BYTES)
        return AuxRow.unpack(raw)

    def read_draft(self, aux_slot: int) -> DraftRow | None:
        """The worker's draft proposal for a DONE room (with a ``draft``; None when the worker
        wrote none into the slot)."""
        self._check_slot(aux_slot)
        return None if self.draft is None else self.draft.rows.read(aux_slot)

    def forget(self, room: int) -> None:
        """Drop a finished room's status; ``ValueError`` while it is PENDING (abort it)."""
        with self._lock:
            if self._rooms.entry(room).status.state is RoomState.PENDING:
                raise ValueError(f"room {room} is pending: abort it and wait for ABORTED first")
            self._rooms.forget(room, wire.notif_tag(room))

    def progress(self) -> None:
        """Drain the worker's messages and NIXL notifications, heartbeat, check liveness."""
        with self._lock:
            if self._is_closed:
                return
            self._link.drain()
            for msgs in self._agent.get_new_notifs().values():
                for tag in msgs:
                    self._rooms.on_landed(tag)
            now = self._clock()
            self._link.tick(now)
            for room, entry in self._rooms.items():
                if entry.status.state is RoomState.PENDING and now >= entry.deadline:
                    self._link.time_out(room, self.room_timeout_s)

    def close(self) -> None:
        if self._io is not None:
            self._io.stop()
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            self._link.close()
            if self._state_reg is not None:
                self._agent.deregister_memory(self._state_reg)
            for reg in reversed(self._draft_regs):
                self._agent.deregister_memory(reg)
            deregister_regions(self._agent, self._reg)

    # -- internals (under the lock) -----------------------------------------------------

    def _io_turn(self) -> float:
        """One turn of the I/O thread: progress; how long it may sleep (NIXL has no fd:
        1 ms while something is pending, else until the next heartbeat is due)."""
        self.progress()
        with self._lock:
            if self._rooms.has_pending or self._link.registration.state is RoomState.PENDING:
                return 0.001
            return max(0.001, min(self.heartbeat_interval_s / 2, 0.05))

    def _progress_if_alone(self) -> None:
        if self._io is None:
            self.progress()

    def _driver(self) -> Callable[[], None] | None:
        """What a waiter calls to make progress: nothing when the I/O thread does."""
        return self.progress if self._io is None else None

    def _check_slot(self, aux_slot: int) -> None:
        if not 0 <= aux_slot < self.regions.num_aux_rows:
            raise ValueError(f"aux_slot {aux_slot} outside 0..{self.regions.num_aux_rows - 1}")

    def _check_state_slot(self, room: int, state_slot: int | None) -> None:
        if self.state is None:
            if state_slot is not None:
                raise ValueError(f"room {room}: a state_slot, but this receiver has no state pool")
            return
        num_items = self.state.component.num_items
        if self.state.component.copy == PAGES:  # lands in the room's own pages
            if state_slot is not None:
                raise ValueError(f"room {room}: a paged state pool takes no state_slot")
            return
        if state_slot is None or not 0 <= state_slot < num_items:
            raise ValueError(f"room {room}: state_slot must be in [0, {num_items})")

    def _register_msg(self) -> wire.Register:
        metadata = wire.frame_metadata(self._agent.get_agent_metadata())
        compat = self.regions.layout.compat_hash()
        tp = msgspec.UNSET if self._rank is None else self._rank
        state: tuple[wire.StatePool, ...] | msgspec.UnsetType = msgspec.UNSET
        if self.state is not None:
            state = (wire.StatePool.of(self.state.component, self.state.base_addrs),)
        draft = msgspec.UNSET if self.draft is None else draft_pool(self.draft)
        return wire.Register.of(self.agent_name, metadata, self.regions, compat, tp, state, draft)


def _decode_rank(regions: KVRegions, rank: int, tp_size: int, num_kv_heads: int) -> wire.DecodeRank:
    heads = kv_head_range(num_kv_heads, rank, tp_size)
    if regions.layout.num_kv_heads != len(heads):
        raise ValueError(
            f"decode rank {rank} of {tp_size} holds {len(heads)} of {num_kv_heads} KV heads; "
            f"its pool has {regions.layout.num_kv_heads}"
        )
    return wire.DecodeRank(rank, tp_size, heads.start, heads.stop)


__all__ = ["KVReceiver", "RegistrationError", "RoomState", "RoomStatus"]
