"""The transfer backend SGLang decode servers talk to: this worker as an SGLang prefill.

Threads: the bootstrap HTTP routes (``bootstrap_http``: ``/route``, ``/health``) and the
PULL control socket (``control``: frames parsed there) run on their own threads and hand
what arrives to the engine through a ``Mailbox``. The NIXL agent is owned by this backend's
transfer thread (``nixl.push_thread``): every NIXL call (registering a decode, posting,
progressing and releasing writes) runs there, so no copy runs on the engine thread.
Everything else is the engine thread's: ``poll()`` gives each message to the ``SglangDesk``
(registrations, requests, aborts), does what senders recorded (replies, held until their
writes settle; closed senders), expires requests whose prefill never came, reads what the
transfer thread finished and reaps writes not yet settled. Between turns the engine sleeps
in ``wait()`` on the mailbox's pipe and the transfer thread's wake fd (both also call
``wake``, for an engine sleeping elsewhere). KV pages go out as in ``nixl.backend`` (one
prepared list per side, a chunk is one WRITE; our list is per layer whatever the pool's
layout, as SGLang's pools are); the first token goes into the decode's metadata buffers
(``sglang.aux``).

Restarts: an SGLang decode keeps a prefill's registration and control address until it misses
``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` (2) heartbeats in a row, 5 s apart by
default; a worker back sooner would find every decode that knew its previous run still sending
to that run. So for ``rejoin_s`` after it starts (just before the engine serves), ``/health``
and ``/route`` answer 503 and a transfer request from a decode this run does not know goes
unanswered: each such decode misses its heartbeats, drops the old registration (failing its
rooms waiting on it), and fetches ``/route`` afresh once the window ends; a new decode's
first ``/route`` waits it out too (SGLang retries it for 15 s).

Decode liveness: SGLang decodes send no heartbeat; they poll ``/health`` (which fails when
this engine has not turned for ``health_stale_s`` or is stuck in a forward by the daemon's
liveness rule) and fail their rooms when it does not
answer. A decode that dies fails its rooms here by their write deadline (or a NIXL error),
by the engine's transfer timeout, or, before any write, by the bootstrap timeout. Its peer
record stays until another agent registers from its control socket's address (it was
restarted) or idle peers past ``MAX_PEERS`` are evicted, least recently seen first.
"""

from __future__ import annotations

import logging
import math
import select
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.base import KVSender
from prefill_worker.transfer.nixl.agent import forget_agent
from prefill_worker.transfer.nixl.poster import WritePoster
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.nixl.reaper import HandleReaper, HeldTells
from prefill_worker.transfer.nixl.sender import STUCK_RELEASE_S
from prefill_worker.transfer.rooms import Gone, RoomBook
from prefill_worker.transfer.sglang import aux, frames
from prefill_worker.transfer.sglang.accept import Network, server_info
from prefill_worker.transfer.sglang.bootstrap_http import BootstrapHttp
from prefill_worker.transfer.sglang.control import ControlSocket, Mailbox, ReplySockets
from prefill_worker.transfer.sglang.desk import SglangDesk
from prefill_worker.transfer.sglang.local import LocalSide, close_all
from prefill_worker.transfer.sglang.refusals import RefusedRooms
from prefill_worker.transfer.sglang.sender import (
    Closed,
    Reply,
    SglangContext,
    SglangPeer,
    SglangSender,
)
from prefill_worker.transfer.validate import BootstrapLimits

log = logging.getLogger(__name__)

MAX_PEERS = 256  # registered decode ranks kept; idle ones past it are evicted
MAX_REGISTRATIONS_PER_TURN = 4  # each loads NIXL metadata; the rest wait for the next turn
_BUSY_POLL_S = 0.001
_IDLE_POLL_S = 1.0
_MAX_CLAIMS_PER_ROOM = 4


class SglangBackend:
    """Makes ``SglangSender``s; serves SGLang's bootstrap routes and control socket."""

    def __init__(
        self,
        regions: KVRegions,
        http_bind: str,
        rank_ip: str,
        rank_port: int,
        kv_cache_dtype: str,
        agent_name: str,
        nixl_backends: list[str],
        write_timeout_s: float,
        want_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        health_stale_s: float = 30.0,
        rejoin_s: float = 0.0,
        is_engine_live: Callable[[], bool] = lambda: True,
        limits: BootstrapLimits | None = None,
        ucx_net_devices: str | None = None,
        on_reject: Callable[[str], None] | None = None,
        wake: Callable[[], None] | None = None,
        poster_factory: Callable[[Any], WritePoster] | None = None,
        allowed_networks: Sequence[Network] = (),
    ) -> None:
        self.clock, self.want_timeout_s = clock, want_timeout_s
        self._write_timeout_s = write_timeout_s
        self.limits = limits or BootstrapLimits()
        self._last_poll_at = clock()
        self._health_stale_s = health_stale_s
        self._opens_at = clock() + rejoin_s  # built just before the engine starts serving
        self._is_engine_live = is_engine_live  # the daemon's liveness verdict (HTTP thread)
        self._mailbox = Mailbox(wake)
        self._closers: list[Callable[[], None]] = [self._mailbox.close]
        try:
            self._start_io(regions, http_bind, rank_ip, rank_port, kv_cache_dtype)
            local = LocalSide(regions, agent_name, nixl_backends, ucx_net_devices)
        except BaseException:
            self._close_all()
            raise
        self._closers.append(local.close)
        self.agent = local.agent
        if poster_factory is None:
            self._poster: WritePoster = PushThread(self.agent, "nixl-push-sglang", wake)
        else:
            self._poster = poster_factory(self.agent)
        # From here the transfer thread owns the agent; close() stops it before the closers.
        self._peers: dict[str, SglangPeer] = {}
        self._senders: dict[int, SglangSender] = {}
        self._rooms = RoomBook(_MAX_CLAIMS_PER_ROOM, self.limits.max_unmatched_wants)
        self._refused_rooms = RefusedRooms(want_timeout_s)
        self._ctx = SglangContext(
            self._poster,
            local.kv_list,
            local.staging,
            aux.AuxRowsView(regions.aux_base_addr, regions.num_aux_rows),
            regions.layout,
            write_timeout_s,
            clock,
        )
        self._reaper = HandleReaper()
        self._held: HeldTells[Reply] = HeldTells(write_timeout_s)
        self._desk = SglangDesk(
            self.agent,
            self._replies,
            regions.layout,
            self.limits,
            (self._peers, self._senders, self._rooms),
            self._drop_peer,
            clock,
            want_timeout_s=want_timeout_s,
            on_reject=on_reject or (lambda reason: None),
            refused_rooms=self._refused_rooms,
            is_rejoining=lambda: not self._is_open(),
            run_on_agent=self._poster.run,
            allowed_networks=allowed_networks,
        )
        self.reject_counts = self._desk.reject_counts
        self._control.start()

    def _start_io(
        self, regions: KVRegions, http_bind: str, rank_ip: str, rank_port: int, dtype: str
    ) -> None:
        """Sockets first: a taken port fails start-up before NIXL is touched."""
        self._control = ControlSocket(
            rank_ip, rank_port, self.limits.max_message_bytes, self._mailbox.put
        )
        self._closers.append(self._control.close)
        rank = {"rank_ip": rank_ip, "rank_port": self._control.endpoint.port}
        info = server_info(regions.layout.page_size, dtype)
        self._http = BootstrapHttp(http_bind, info, rank, self._is_healthy, self._is_open)
        self._http.start()
        self._closers.append(self._http.stop)
        self._replies = ReplySockets()
        self._closers.append(self._replies.close)
        self.bootstrap_endpoint = self._http.address
        self.endpoints: Mapping[str, str] = {
            "sglang_bootstrap": self._http.address,
            "sglang_control": self._control.endpoint.address,
        }

    # -- the TransferBackend seam -------------------------------------------------------

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender:
        self._drain_events()
        sender = SglangSender(self._ctx, room, request_id, num_prompt_tokens, allowed_peer)
        if room in self._senders:  # the request holding the room goes on untouched
            sender.fail("its bootstrap_room is already in use by another request")
            return sender
        self._senders[room] = sender
        aborted_by = self._rooms.take_aborted(room)
        claims = self._rooms.take(room)
        winner = next((c for c in claims if sender.accepts(c.peer.agent_name)), None)
        for claim in claims:
            peer = self._peers[claim.peer.agent_name]
            if claim is winner:
                self._desk.bind(sender, peer, claim.want)
            else:
                self._desk.refuse_room(peer.endpoint, room, self._desk.why_not(sender, peer))
        if winner is None and aborted_by is not None and sender.accepts(aborted_by):
            sender.abort_by_peer(None, None)  # its ABORT was acknowledged when it came
        refused = self._refused_rooms.take(room, self.clock())
        if winner is None and refused is not None and sender.accepts(refused.agent_name):
            sender.fail(refused.reason)  # its decode was told when its request came
        return sender

    def poll(self) -> None:
        self._poster.clear_wake()  # before reading write states: a later change wakes wait()
        now = self._last_poll_at = self.clock()
        for received in self._mailbox.take(MAX_REGISTRATIONS_PER_TURN):
            self._desk.dispatch(received.message, received.source_ip)
        self._drain_events()
        for claim in self._rooms.pop_expired(now):  # claims leave with their peer: it is here
            peer = self._peers[claim.peer.agent_name]
            status = frames.kv_status(claim.want.room, False, "prefill request never arrived")
            self._replies.send(peer.endpoint, status)
        for sender in list(self._senders.values()):
            sender.progress()
        self._drain_events()
        self._reaper.reap(now, self._drop_stuck_peer)
        for held in self._held.take_ready(now):
            self._send(held)
        self._evict_idle_peers()

    def next_poll_at(self) -> float:
        now = self.clock()
        if self._ctx.events or self._mailbox.has_items:
            return now
        is_waiting = len(self._reaper) or len(self._held)
        if self._poster.needs_polling and (
            is_waiting or any(s.needs_progress for s in self._senders.values())
        ):
            return now + _BUSY_POLL_S
        if is_waiting:  # the transfer thread wakes us when a write settles; this bounds it
            return now + _IDLE_POLL_S / 10
        claims_at = self._rooms.next_deadline()
        return min(now + _IDLE_POLL_S, math.inf if claims_at is None else claims_at)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        timeout_s = min(timeout_s, self.next_poll_at() - self.clock())
        if timeout_s > 0:
            fds = (self._mailbox.fileno(), wake_fd, self._poster.wake_fd)
            select.select([fd for fd in fds if fd is not None], [], [], timeout_s)

    def close(self) -> None:
        for sender in list(self._senders.values()):
            sender.close()
        self._drain_events()
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "prefill worker shutting down")
        self._drain_events()
        self._poster.close()  # releases what is left; the agent is this thread's again
        self._reaper.reap(math.inf, self._drop_stuck_peer)
        for reply in self._held.take_ready(math.inf):
            self._send(reply)
        self._close_all()

    # -- for tests and metrics ----------------------------------------------------------

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    @property
    def num_open_senders(self) -> int:
        return sum(not s.is_closed for s in self._senders.values())

    def num_inflight_transfers(self) -> int:
        return sum(s.num_inflight for s in self._senders.values()) + len(self._reaper)

    def check_integrity(self) -> None:
        closing = {id(e.sender) for e in self._ctx.events if isinstance(e, Closed)}
        for room, sender in self._senders.items():
            assert sender.room == room and (not sender.is_closed or id(sender) in closing)
            assert sender.peer is None or sender.peer.peer.agent_name in self._peers
        for name, peer in self._peers.items():
            assert peer.peer.agent_name == name
            assert all(self._senders[r].peer is peer for r in peer.peer.rooms)
        self._rooms.check_integrity([p.peer for p in self._peers.values()])

    # -- internals ----------------------------------------------------------------------

    def _is_healthy(self) -> bool:  # the HTTP thread
        """Polled lately, and the engine live: this backend also turns while a forward runs,
        so a stuck forward shows only in the engine's liveness."""
        is_fresh = self.clock() - self._last_poll_at <= self._health_stale_s
        return is_fresh and self._is_engine_live()

    def _is_open(self) -> bool:  # the HTTP thread
        return self.clock() >= self._opens_at

    def _drain_events(self) -> None:
        events = self._ctx.events
        while events:
            match events.pop(0):
                case Reply(after=after) as reply if not all(w.is_settled for w in after):
                    self._held.hold(reply, self.clock())
                case Reply() as reply:
                    self._send(reply)
                case Closed(sender, stuck):
                    self._forget(sender, stuck)

    def _send(self, reply: Reply) -> None:
        is_sent = self._replies.send(reply.endpoint, reply.frames)
        if reply.confirm is not None:
            reply.confirm.confirm_ok(is_sent)

    def _forget(self, sender: SglangSender, stuck: tuple[Any, ...]) -> None:
        if self._senders.get(sender.room) is sender:
            del self._senders[sender.room]
        identity = None if sender.peer is None else sender.peer.peer.identity
        deadline = self.clock() + min(STUCK_RELEASE_S, self._write_timeout_s)
        self._reaper.add(stuck, sender.request_id, identity, deadline)
        if sender.peer is not None:
            sender.peer.peer.rooms.discard(sender.room)
        elif sender.failure_reason() is not None and sender.room not in self._senders:
            forget_at = self.clock() + self.want_timeout_s
            gone = Gone(sender.failure_reason() or "", sender.allowed_peer, forget_at)
            self._rooms.mark_gone(sender.room, gone)

    def _drop_stuck_peer(self, identity: bytes | None) -> None:
        peer = self._peers.get((identity or b"").decode())
        if peer is not None:
            self._drop_peer(peer, "writes could not be cancelled")

    def _evict_idle_peers(self) -> None:
        if len(self._peers) <= MAX_PEERS:
            return
        idle = [p for p in self._peers.values() if not p.peer.rooms and not p.peer.unmatched]
        idle.sort(key=lambda p: p.peer.last_seen)
        for peer in idle[: max(0, len(self._peers) - MAX_PEERS)]:
            self._drop_peer(peer, f"more than {MAX_PEERS} decode ranks registered; idle longest")

    def _drop_peer(self, peer: SglangPeer, reason: str) -> None:
        """Fail every request bound to the peer, cancel its writes, forget its agent."""
        name = peer.peer.agent_name
        log.info("sglang: dropping decode %s: %s", name, reason)
        del self._peers[name]
        for sender in [s for s in self._senders.values() if s.peer is peer]:
            sender.lose_peer(reason)
        self._drain_events()
        for room in list(peer.peer.unmatched):
            self._rooms.drop(room, peer.peer)
            self._replies.send(peer.endpoint, frames.kv_status(room, False, reason))
        peer.peer.rooms.clear()
        # On the transfer thread, after the releases of its writes queued above.
        self._poster.run_later(forget_agent, self.agent, peer.peer.agent_name, peer.peer.lists)

    def _close_all(self) -> None:
        close_all(self._closers, "the backend")
