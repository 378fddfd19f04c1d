"""The production transfer backend: NIXL WRITEs from this worker's KV pool into decode pools.

One agent per worker (NIXL's progress thread off), owned by the transfer thread
(``nixl.push_thread``, or ``InlinePoster`` by ``poster_factory``): every NIXL call runs there,
never a copy on the engine thread. ``poll()`` (engine loop) drains the bootstrap server,
drives every sender (which reads what the transfer thread finished), does what senders
recorded (``nixl.context.SenderEvent``: statuses, sent once their writes settled; closed
senders; writes to reap), sends heartbeats, enforces deadlines. Between turns the engine
sleeps in ``wait()`` on the bootstrap socket and the transfer thread's wake fd, until
``next_poll_at()``. The pool and aux rows are registered and the local descriptor list
prepared once, each decode peer's list once at registration (``pagemap``; registering
waits for the write the transfer thread is posting), so a chunk is one ``make_prepped_xfer``.

Per request: ``send_pages`` queues one WRITE of the chunk's pages (adjacent pages merge into
single descriptors); ``send_aux`` asks for the aux row, posted once every page write has
landed, with a NIXL notification; when it lands the peer gets ``status ok``. A peer silent
past ``peer_timeout_s``, a write in flight past it, or a NIXL error fails the request (the
peer is told when reachable, once the writes are released). What each bootstrap message
means is ``nixl.protocol``'s; writes not yet settled are ``nixl.reaper``'s. This module
owns the tables and drives the clock.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from prefill_worker.curve import CurveServerKeys
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVSender
from prefill_worker.transfer.bootstrap import BootstrapServer
from prefill_worker.transfer.nixl.agent import (
    deregister_regions,
    forget_agent,
    make_agent,
    prep_lists,
    register_regions,
)
from prefill_worker.transfer.nixl.context import Closed, Peer, SendContext, Tell
from prefill_worker.transfer.nixl.poster import WritePoster
from prefill_worker.transfer.nixl.protocol import UNKNOWN_PEER, BootstrapDesk
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.nixl.reaper import HandleReaper, HeldTells
from prefill_worker.transfer.nixl.sender import STUCK_RELEASE_S, NixlSender, notif_tag
from prefill_worker.transfer.rooms import Gone, RoomBook
from prefill_worker.transfer.validate import BootstrapLimits

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.001  # NIXL has no fd: while writes are in flight the engine polls this often
_MAX_CLAIMS_PER_ROOM = 4  # wants for one room, from distinct peers, before its request


class NixlBackend:
    """Makes ``NixlSender``s and drives the bootstrap protocol and all transfers."""

    def __init__(
        self,
        regions: KVRegions,
        bootstrap_bind: str,
        agent_name: str,
        nixl_backends: list[str],
        peer_timeout_s: float,
        heartbeat_interval_s: float,
        want_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        limits: BootstrapLimits | None = None,
        curve: CurveServerKeys | None = None,
        ucx_net_devices: str | None = None,
        on_reject: Callable[[str], None] | None = None,
        poster_factory: Callable[[Any], WritePoster] = PushThread,
        is_engine_live: Callable[[], bool] = lambda: True,
    ) -> None:
        self.regions = regions
        self.agent_name = agent_name
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.want_timeout_s = want_timeout_s
        self.clock = clock
        # Heartbeats say the engine is alive: they stop while the daemon's liveness rule
        # finds it stuck (this backend also turns during forwards), so decodes give up.
        self._is_engine_live = is_engine_live
        self.limits = limits or BootstrapLimits()
        # First: a taken port fails fast.
        self._server = BootstrapServer(bootstrap_bind, self.limits.max_message_bytes, curve)
        self.bootstrap_endpoint = self._server.endpoint
        try:
            self.agent = make_agent(agent_name, nixl_backends, ucx_net_devices)
            self._reg = register_regions(self.agent, regions)
            self.local_lists = prep_lists(self.agent, "NIXL_INIT_AGENT", regions)
        except BaseException:
            self._server.close()
            raise
        self._poster = poster_factory(self.agent)  # owns the agent from here to close()
        self._peers: dict[bytes, Peer] = {}  # routing id -> peer
        self._senders: dict[int, NixlSender] = {}  # room -> open sender
        self._rooms = RoomBook(_MAX_CLAIMS_PER_ROOM, self.limits.max_unmatched_wants)
        self._ctx = SendContext(
            self.agent,
            self.local_lists,
            regions.layout,
            peer_timeout_s,
            clock,
            poster=self._poster,
        )
        self._reaper = HandleReaper()
        self._held: HeldTells[Tell] = HeldTells(peer_timeout_s)
        self._next_heartbeat = clock()
        self._desk = BootstrapDesk(
            self._server,
            self.agent,
            regions.layout,
            self.limits,
            (self._peers, self._senders, self._rooms),
            self._drop_peer,
            clock,
            agent_name=agent_name,
            heartbeat_interval_s=heartbeat_interval_s,
            peer_timeout_s=peer_timeout_s,
            want_timeout_s=want_timeout_s,
            on_reject=on_reject or (lambda reason: None),
            refused=self._ctx.refused,
            run_on_agent=self._poster.run,
        )
        self.reject_counts = self._desk.reject_counts  # the same dict: counts as they happen

    # -- the TransferBackend seam -------------------------------------------------------

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender:
        self._drain_events()  # a sender closed since the last poll gives its room back
        sender = NixlSender(self._ctx, room, request_id, num_prompt_tokens, allowed_peer)
        if room in self._senders:  # the request holding the room goes on untouched
            # No room number in the text: it reaches the outcome log, and rooms are capabilities.
            sender.fail("its bootstrap_room is already in use by another request")
            return sender
        self._senders[room] = sender
        aborted_by = self._rooms.take_aborted(room)
        claims = self._rooms.take(room)
        winner = next((c for c in claims if sender.accepts(c.peer.agent_name)), None)
        for claim in claims:
            if claim is not winner:
                why = self._desk.why_not(sender, claim.peer)
                self._desk.refuse_room(claim.peer.identity, room, why)
        if winner is not None:
            self._desk.bind(sender, winner.peer, winner.want)
        elif aborted_by is not None and sender.accepts(aborted_by):
            sender.abort_by_peer()  # its decode gave up before the request came: end now
        elif (refused := self._refusal_of(allowed_peer)) is not None:
            sender.fail(f"registration refused: {refused}")  # its decode will never ask
        return sender

    def _refusal_of(self, agent_name: str | None) -> str | None:
        if agent_name is None:
            return None
        return self._ctx.refused.reason_for(agent_name, self.clock())

    def poll(self) -> None:
        self._poster.clear_wake()  # before reading write states: a later change wakes wait()
        for identity, msg in self._server.poll():
            self._desk.dispatch(identity, msg)
        self._drain_events()  # statuses from the engine's fail()/close() since the last poll
        now = self.clock()
        self._expire(now)  # first: a silent peer, not its writes' deadline, is the cause
        for sender in list(self._senders.values()):
            sender.progress()
        self._drain_events()
        self._reap(now)
        for tell in self._held.take_ready(now):
            self._tell(tell)
        if now >= self._next_heartbeat and self._is_engine_live():
            self._next_heartbeat = now + self.heartbeat_interval_s
            for identity in list(self._peers):
                self._server.send(identity, wire.Heartbeat())

    def next_poll_at(self) -> float:
        """The earliest time (this backend's clock) ``poll`` has work that no message starts:
        now with events to drain, soon while NIXL writes are in flight (no fd to wait on),
        else the next heartbeat, peer timeout or unmatched-want deadline."""
        now = self.clock()
        if self._ctx.events:
            return now
        is_waiting = len(self._reaper) or len(self._held)
        if self._poster.needs_polling and (
            is_waiting or any(s.needs_progress for s in self._senders.values())
        ):
            return now + _BUSY_POLL_S
        silent_at = (p.last_seen + self.peer_timeout_s for p in self._peers.values())
        times = [self._next_heartbeat, *silent_at]
        claims_at = self._rooms.next_deadline()
        if claims_at is not None:
            times.append(claims_at)
        return min(times)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Block until a bootstrap message arrives, ``wake_fd`` is readable, ``next_poll_at``
        comes, or ``timeout_s`` passes."""
        timeout_s = min(timeout_s, self.next_poll_at() - self.clock())
        if timeout_s > 0:
            poster_fd = self._poster.wake_fd
            self._server.wait(timeout_s, wake_fd, () if poster_fd is None else (poster_fd,))

    def close(self) -> None:
        for sender in list(self._senders.values()):
            sender.close()
        self._drain_events()
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "prefill worker shutting down")
        self._drain_events()
        self._poster.close()  # releases what is left; the agent is this thread's again
        self._reap(math.inf)
        for tell in self._held.take_ready(math.inf):
            self._tell(tell)
        self.local_lists.release()
        deregister_regions(self.agent, self._reg)
        self._server.close()

    # -- for tests and metrics ----------------------------------------------------------

    @property
    def num_open_senders(self) -> int:
        return sum(not s.is_closed for s in self._senders.values())

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def num_claims(self, room: int) -> int:
        """Wants waiting for the room's request."""
        return self._rooms.num_claims(room)

    def has_peer(self, agent_name: str) -> bool:
        return any(p.agent_name == agent_name for p in self._peers.values())

    def num_inflight_transfers(self) -> int:
        return sum(s.num_inflight for s in self._senders.values()) + len(self._reaper)

    def check_integrity(self) -> None:
        closing = {id(e.sender) for e in self._ctx.events if isinstance(e, Closed)}
        for room, sender in self._senders.items():
            assert sender.room == room and (not sender.is_closed or id(sender) in closing)
            assert sender.peer is None or sender.peer.identity in self._peers
        for peer in self._peers.values():
            assert all(self._senders[r].peer is peer for r in peer.rooms)
        self._rooms.check_integrity(list(self._peers.values()))
        names = [p.agent_name for p in self._peers.values()]
        assert len(names) == len(set(names)), "one peer per agent name"

    # -- what senders asked for --------------------------------------------------------

    def _drain_events(self) -> None:
        """Do what senders recorded, in order (a status, then forgetting, say); a status
        whose writes have not settled is held (``HeldTells``)."""
        events = self._ctx.events
        while events:
            match events.pop(0):
                case Tell(after=after) as tell if not all(w.is_settled for w in after):
                    self._held.hold(tell, self.clock())
                case Tell() as tell:
                    self._tell(tell)
                case Closed(sender, stuck):
                    self._forget(sender, stuck)

    def _tell(self, tell: Tell) -> None:
        is_delivered = self._server.send(tell.identity, tell.status)
        if tell.confirm is not None:
            tell.confirm.confirm_ok(is_delivered)

    def _forget(self, sender: NixlSender, stuck: tuple[Any, ...]) -> None:
        """A closed sender leaves the tables; a late `want` for its room learns why."""
        if self._senders.get(sender.room) is sender:
            del self._senders[sender.room]
        identity = None if sender.peer is None else sender.peer.identity
        deadline = self.clock() + min(STUCK_RELEASE_S, self.peer_timeout_s)
        self._reaper.add(stuck, sender.request_id, identity, deadline)
        if sender.peer is not None:
            sender.peer.rooms.discard(sender.room)
        elif sender.failure_reason() is not None and sender.room not in self._senders:
            forget_at = self.clock() + self.want_timeout_s
            gone = Gone(sender.failure_reason() or "", sender.allowed_peer, forget_at)
            self._rooms.mark_gone(sender.room, gone)

    def _reap(self, now: float) -> None:
        self._reaper.reap(now, self._drop_stuck_peer)

    def _drop_stuck_peer(self, identity: bytes | None) -> None:
        peer = self._peers.get(identity or b"")
        if peer is not None:
            self._drop_peer(peer, "writes could not be cancelled")

    # -- liveness -----------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if now - peer.last_seen > self.peer_timeout_s:
                self._drop_peer(peer, f"decode peer silent for over {self.peer_timeout_s:g} s")
        for claim in self._rooms.pop_expired(now):
            status = wire.Status(claim.want.room, "failed", "prefill request never arrived")
            self._server.send(claim.peer.identity, status)

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        """Fail every request bound to the peer, cancel its writes, forget its agent."""
        log.info("bootstrap: dropping decode peer %s: %s", peer.agent_name, reason)
        del self._peers[peer.identity]
        for sender in [s for s in self._senders.values() if s.peer is peer]:
            sender.lose_peer(reason)
        self._drain_events()  # their `failed` goes out first (held while writes settle)
        for room in list(peer.unmatched):  # not an outcome: the SDK registers and asks again
            self._rooms.drop(room, peer)
            status = wire.Status(room, "failed", f"{UNKNOWN_PEER}: {reason}", "unknown_peer")
            self._server.send(peer.identity, status)
        peer.rooms.clear()
        # On the transfer thread, after the releases of its writes queued above.
        self._poster.run_later(forget_agent, self.agent, peer.agent_name, peer.lists)


__all__ = ["NixlBackend", "notif_tag"]
