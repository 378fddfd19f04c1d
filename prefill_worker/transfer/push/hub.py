"""The protocol-neutral owner of a backend's push state: peers, open senders, rooms and
claims (``rooms``), refusal counts, the senders' events, writes to reap and statuses held
until their writes settle. A protocol's backend keeps its sockets and threads and hands each
message to its desk; the desk calls the hub for what both protocols do alike (a `want`, an
abort, a refusal, dropping a peer). Every NIXL call goes through the poster (the transfer
thread); a peer's agent is forgotten there, after its writes' releases.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Generic

from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll, KVSender
from prefill_worker.transfer.nixl.agent import forget_agent
from prefill_worker.transfer.nixl.poster import Write
from prefill_worker.transfer.nixl.reaper import HandleReaper, HeldTells
from prefill_worker.transfer.options import Hooks, NativeOptions, SglangOptions
from prefill_worker.transfer.push.dialect import ABORTED_BY_DECODE
from prefill_worker.transfer.push.peer import P
from prefill_worker.transfer.push.refusals import Refusals, RejectCounter
from prefill_worker.transfer.push.rooms import Gone, RoomBook
from prefill_worker.transfer.push.sender import (
    STUCK_RELEASE_S,
    Closed,
    PushContext,
    PushSender,
    Tell,
)
from prefill_worker.transfer.validate import Refusal, duplicate_want, foreign_room

log = logging.getLogger(__name__)

BUSY_POLL_S = 0.001  # NIXL has no fd: while writes are in flight the engine polls this often
_WAITING_POLL_S = 0.1  # the transfer thread wakes us when a write settles; this bounds it
_MAX_CLAIMS_PER_ROOM = 4  # wants for one room before its request (a wider decode: its ranks)


class PushHub(Generic[P]):
    """Peers by identity, senders by room, claims; drives every sender from the engine loop."""

    def __init__(
        self,
        ctx: PushContext[P],
        agent: Any,  # nixl_agent, owned by ctx.poster
        counter: RejectCounter,
        refusals: Refusals,
        want_timeout_s: float,
        max_unmatched_wants: int,
    ) -> None:
        self.ctx, self._agent, self.counter = ctx, agent, counter
        self.refusals = refusals
        self.want_timeout_s = want_timeout_s
        self.peers: dict[bytes, P] = {}
        self.num_dropped = 0  # peers dropped so far (a tensor-parallel leader mirrors them)
        self.senders: dict[int, PushSender[P]] = {}
        self.rooms: RoomBook[P] = RoomBook(_MAX_CLAIMS_PER_ROOM, max_unmatched_wants)
        self._reaper = HandleReaper()
        self._held: HeldTells[Tell[P]] = HeldTells(ctx.write_timeout_s)
        self.clock = ctx.clock
        self.claimed: list[int] = []  # rooms bound by a want since the engine last looked
        # At attention DP > 1: why a room is another rank's (docs/parallelism.md), else None.
        self.elsewhere: Callable[[int], Refusal | None] = _served_here

    # -- requests -----------------------------------------------------------------------

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> PushSender[P]:
        """A sender for the room, bound to the acceptable claims waiting for it (the first,
        and the other ranks of its decode); ended at once when its decode aborted it or was
        refused before it came."""
        self.drain()  # a sender closed since the last turn gives its room back
        sender = PushSender(
            self.ctx, room, request_id, num_prompt_tokens, allowed_peer, traceparent
        )
        if room in self.senders:  # the request holding the room goes on untouched
            # No room number in the text: it reaches the outcome log, and rooms are capabilities.
            sender.fail("its bootstrap_room is already in use by another request")
            return sender
        self.senders[room] = sender
        aborted_by = self.rooms.take_aborted(room)
        claims = self.rooms.take(room)
        winner = None
        for claim in claims:
            if sender.accepts_rank(claim.peer):
                winner = winner or claim
                self.bind(sender, claim.peer, claim.want)
            else:
                self.refuse_room(claim.peer, room, self.why_not(sender, claim.peer))
        if winner is None and aborted_by is not None and sender.accepts(aborted_by):
            sender.abort_by_peer(is_ack_due=False)  # acknowledged when its abort came
        elif winner is None and (why := self._refusal_of(sender)) is not None:
            sender.fail(why)  # its decode was refused: it will never claim the room
        return sender

    def _refusal_of(self, sender: PushSender[P]) -> str | None:
        now = self.clock()
        refused = self.refusals.rooms.take(sender.room, now)
        if refused is not None and sender.accepts(refused.agent_name):
            return refused.reason
        if sender.allowed_peer is None:
            return None
        why = self.refusals.names.get(sender.allowed_peer, now)
        return None if why is None else f"registration refused: {why}"

    def want(self, peer: P, want: wire.Want) -> None:
        """A peer's `want` its desk accepted: binds the room's sender, or waits for it."""
        room, sender = want.room, self.senders.get(want.room)
        if sender is not None:
            if not sender.accepts_rank(peer):
                return self.refuse_room(peer, room, self.why_not(sender, peer))
            return self.bind(sender, peer, want)
        elsewhere = self.elsewhere(room)
        if elsewhere is not None:  # its request never comes here: fail it now, with the rank
            return self.refuse_room(peer, room, elsewhere)
        gone = self.rooms.gone(room)
        if gone is not None:
            if gone.allowed_peer not in (None, peer.agent_name):
                return self.refuse_room(peer, room, foreign_room(room))
            self.rooms.forget_gone(room)
            self.ctx.dialect.send(peer, wire.Status(room, "failed", gone.reason))
            return None
        refusal = self.rooms.claim(peer, want, self.clock() + self.want_timeout_s)
        if refusal is not None:
            self.refuse_room(peer, room, refusal)

    def abort(self, peer: P, room: int, generation: int | None = None) -> None:
        """Only the owner's abort acts; every abort is acknowledged (the owner's after the
        room's writes), and one of a waiting `want` ends the request when it comes."""
        sender = self.senders.get(room)
        if sender is not None and peer in sender.peers:
            return sender.abort_by_peer(generation)
        if self.rooms.drop(room, peer):  # its want was waiting: the request may still come
            self.rooms.mark_aborted(room, peer.agent_name, self.clock() + self.want_timeout_s)
        self.ctx.dialect.send(peer, wire.Status(room, "aborted", ABORTED_BY_DECODE), generation)

    def bind(self, sender: PushSender[P], peer: P, want: wire.Want) -> None:
        sender.bind(peer, want)
        if sender.poll() is KVPoll.READY:
            for bound in sender.peers:
                bound.rooms.add(sender.room)
            self.claimed.append(sender.room)

    def take_claimed(self) -> list[int]:
        """``TransferBackend.take_claimed_rooms``."""
        claimed, self.claimed = self.claimed, []
        return claimed

    def refuse_room(self, peer: P, room: int, refusal: Refusal) -> None:
        self.counter.count(refusal.reason, refusal.message, level=logging.DEBUG)  # rooms: private
        status = wire.Status(room, "failed", refusal.message, refusal.reason.value)
        self.ctx.dialect.send(peer, status)

    @staticmethod
    def why_not(sender: PushSender[P], peer: P) -> Refusal:
        if not sender.accepts(peer.agent_name):
            return foreign_room(sender.room)
        return duplicate_want(sender.room)

    # -- the engine loop ----------------------------------------------------------------

    def turn(self, now: float) -> None:
        """Expire waiting wants, progress every sender, do what they recorded, reap."""
        for claim in self.rooms.pop_expired(now):
            status = wire.Status(claim.want.room, "failed", "prefill request never arrived")
            self.ctx.dialect.send(claim.peer, status)
        for sender in list(self.senders.values()):
            sender.progress()
        self.drain()
        self._reaper.reap(now, self.drop_stuck_peer)
        for tell in self._held.take_ready(now):
            self._tell(tell)

    def next_poll_at(self, now: float) -> float | None:
        """When a turn has work no message starts (None: only waiting wants' deadlines)."""
        if self.ctx.events:
            return now
        is_waiting = bool(len(self._reaper) or len(self._held))
        is_progressing = any(s.needs_progress for s in self.senders.values())
        if self.ctx.poster.needs_polling and (is_waiting or is_progressing):
            return now + BUSY_POLL_S
        if is_waiting:
            return now + _WAITING_POLL_S
        return self.rooms.next_deadline()

    def drain(self) -> None:
        """Do what senders recorded, in order (a status, then forgetting, say); a status
        whose writes have not settled is held (``HeldTells``)."""
        events = self.ctx.events
        while events:
            match events.pop(0):
                case Tell(after=after) as tell if not all(w.is_settled for w in after):
                    self._held.hold(tell, self.clock())
                case Tell() as tell:
                    self._tell(tell)
                case Closed(sender, stuck):
                    self._forget(sender, stuck)

    # -- peers --------------------------------------------------------------------------

    def drop_peer(self, peer: P, reason: str) -> None:
        """Fail every request bound to the peer, cancel its writes, forget its agent."""
        log.info("%s: dropping decode peer %s: %s", self.counter.protocol, peer.agent_name, reason)
        del self.peers[peer.identity]
        self.num_dropped += 1
        for sender in [s for s in self.senders.values() if peer in s.peers]:
            sender.lose_peer(reason, peer)
        self.drain()  # their `failed` goes out first (held while writes settle)
        for room in list(peer.unmatched):
            self.rooms.drop(room, peer)
            self.ctx.dialect.send(peer, self.ctx.dialect.dropped(room, reason))
        peer.rooms.clear()
        # On the transfer thread, after the releases of its writes queued above.
        others = () if peer.state is None else (peer.state.prepped,)
        self.ctx.poster.run_later(forget_agent, self._agent, peer.agent_name, peer.lists, *others)

    def drop_stuck_peer(self, identity: bytes | None) -> None:
        peer = self.peers.get(identity or b"")
        if peer is not None:
            self.drop_peer(peer, "writes could not be cancelled")

    def close(self) -> None:
        """Close every sender, drop every peer, stop the transfer thread, flush the rest."""
        for sender in list(self.senders.values()):
            sender.close()
        self.drain()
        for peer in list(self.peers.values()):
            self.drop_peer(peer, "prefill worker shutting down")
        self.drain()
        self.ctx.poster.close()  # releases what is left; the agent is this thread's again
        self._reaper.reap(math.inf, self.drop_stuck_peer)
        for tell in self._held.take_ready(math.inf):
            self._tell(tell)

    # -- for tests and metrics ----------------------------------------------------------

    @property
    def num_open_senders(self) -> int:
        return sum(not s.is_closed for s in self.senders.values())

    def num_inflight_transfers(self) -> int:
        return sum(s.num_inflight for s in self.senders.values()) + len(self._reaper)

    def has_peer(self, agent_name: str) -> bool:
        return any(p.agent_name == agent_name for p in self.peers.values())

    def check_integrity(self) -> None:
        closing = {id(e.sender) for e in self.ctx.events if isinstance(e, Closed)}
        for room, sender in self.senders.items():
            assert sender.room == room and (not sender.is_closed or id(sender) in closing)
            assert all(p.identity in self.peers for p in sender.peers)
        for identity, peer in self.peers.items():
            assert peer.identity == identity
            assert all(peer in self.senders[r].peers for r in peer.rooms)
        self.rooms.check_integrity(list(self.peers.values()))
        names = [p.agent_name for p in self.peers.values()]
        assert len(names) == len(set(names)), "one peer per agent name"

    # -- internals ----------------------------------------------------------------------

    def _tell(self, tell: Tell[P]) -> None:
        is_delivered = self.ctx.dialect.send(tell.peer, tell.status, tell.generation)
        if tell.confirm is not None:
            tell.confirm.confirm_ok(is_delivered)

    def _forget(self, sender: PushSender[P], stuck: tuple[Write, ...]) -> None:
        """A closed sender leaves the tables; a late `want` for its room learns why."""
        if self.senders.get(sender.room) is sender:
            del self.senders[sender.room]
        identity = None if sender.peer is None else sender.peer.identity
        deadline = self.clock() + min(STUCK_RELEASE_S, self.ctx.write_timeout_s)
        self._reaper.add(stuck, sender.request_id, identity, deadline)
        for peer in sender.peers:
            peer.rooms.discard(sender.room)
        is_unbound = not sender.peers and sender.failure_reason() is not None
        if is_unbound and sender.room not in self.senders:
            forget_at = self.clock() + self.want_timeout_s
            gone = Gone(sender.failure_reason() or "", sender.allowed_peer, forget_at)
            self.rooms.mark_gone(sender.room, gone)


def _served_here(room: int) -> Refusal | None:
    """One rank serves every room (attention DP 1)."""
    return None


class HubBackend(Generic[P]):
    """What a backend driven by a hub answers alike: new senders, and what tests and metrics
    read. A protocol's backend adds its sockets, threads and desk."""

    _hub: PushHub[P]

    def _start_hub(
        self,
        ctx: PushContext[P],
        agent: Any,
        refusals: Refusals,
        kind: str,
        options: NativeOptions | SglangOptions,
        hooks: Hooks,
    ) -> PushHub[P]:
        """The hub, its refusals counted under ``kind`` (``reject_counts``) and told to
        ``hooks.on_reject``."""
        counter = RejectCounter(kind, hooks.on_reject)
        limits = options.limits
        self._hub = PushHub(
            ctx, agent, counter, refusals, options.want_timeout_s, limits.max_unmatched_wants
        )
        return self._hub

    def serve_rooms_of(self, elsewhere: Callable[[int], Refusal | None]) -> None:
        """At attention DP > 1: a decode's want for a room ``elsewhere`` names another rank
        for is refused at once with that reason (its request never comes to this rank)."""
        self._hub.elsewhere = elsewhere

    @property
    def reject_counts(self) -> dict[str, int]:
        """Refused messages by reason, as they happen."""
        return self._hub.counter.counts

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        return self._hub.create_sender(
            room, request_id, num_prompt_tokens, allowed_peer, traceparent
        )

    def take_claimed_rooms(self) -> Sequence[int]:
        return self._hub.take_claimed()

    @property
    def num_open_senders(self) -> int:
        return self._hub.num_open_senders

    @property
    def num_peers(self) -> int:
        return len(self._hub.peers)

    def num_claims(self, room: int) -> int:
        """Wants waiting for the room's request."""
        return self._hub.rooms.num_claims(room)

    def has_peer(self, agent_name: str) -> bool:
        return self._hub.has_peer(agent_name)

    @property
    def num_dropped_peers(self) -> int:
        """Peers dropped so far (``transfer.group.DropsPeers``)."""
        return self._hub.num_dropped

    def num_inflight_transfers(self) -> int:
        return self._hub.num_inflight_transfers()

    def check_integrity(self) -> None:
        self._hub.check_integrity()
