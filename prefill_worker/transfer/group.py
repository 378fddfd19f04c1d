"""One ``TransferBackend`` over a tensor-parallel group: the leader's own backend, mirrored to
every follower's, and one agreed state per room.

At TP > 1 each rank pushes its own KV heads from its own pool through its own backend (own
NIXL agent, own registration). The engine still talks to one backend: this one. Every call a
sender gets (``create_sender``, ``send_pages``, ``send_aux``, ``fail``, ``close``) runs on the
leader's backend and is queued as a ``MirrorOp`` for the followers, which apply it to theirs
(``tp/mirror.py``; the ops travel on the group's next step, after the forward that computed
the pages). Each step the ranks agree each open room's state by one all-reduce MIN over
``STATE_CODES``::

    failed-like (any rank)  <  BOOTSTRAPPING  <  READY  <  TRANSFERRING  <  SUCCESS

so a room is SUCCESS only when every rank's writes landed, and failed as soon as any rank's
push failed (the code of the rank whose failure is lowest wins: PEER_LOST < ABORTED < FAILED).
Until the followers have answered for a room, its state is the leader's, capped at
TRANSFERRING: it never succeeds on the leader's word alone.

Decodes register with the leader only. Before a room's first pages, the leader mirrors what
its sender was bound to (a sender that has ``bound()``, the push engine's, either protocol's:
an SGLang decode rank's registration is carried as a native `register`): each decode rank's
`register` not mirrored yet (``peer``; once per registration), then the room's decode ranks
and their `want`s (``bind``), so each follower writes its heads into the same pages. The aux
row (and so the `ok` status, which follows it) waits on the leader until the followers agree
their writes landed (their SUCCESS, which a follower reaches only after the mirrored ``aux``):
the status goes once, after every rank's writes.

When the leader's backend drops a decode rank it mirrored (`bye`, liveness timeout, a
re-registration under a new name, a stuck write: ``has_peer`` turns false, noticed at the
backend's next ``poll`` after its ``num_dropped_peers`` moved), the followers drop it too
(``drop``, its agent name, queued after every op already queued: the fail or close of its
rooms that the engine gave before): each follower fails the rooms bound to it and forgets
its agent once none of their writes can land. A decode rank never mirrored costs no op; the
same name registering again is mirrored afresh (``peer``) by the next room it binds.

A status that lets the decode reuse its pages (``failed``, ``aborted``) waits, like the
leader's own, until no byte of the room can land: the leader's sender holds it for its own
writes and for the followers' (``FollowerWrites``, given to it with the room's binding), which
are settled once every follower reported so in an exchange after the room's fail or close
reached it (the follower releases its writes on either). The sender's hold is bounded
(``transfer.peer_timeout_s``, then the status goes with a warning), and the transfer backend's
close lets every held status go (the group is stopping: its followers are killed next).
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from prefill_worker.request import TransferStats
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll, KVSender, TransferBackend
from prefill_worker.transfer.swa_window import WindowWant

if TYPE_CHECKING:  # importing the poster imports NIXL; this module stays free of it
    from prefill_worker.transfer.nixl.poster import Telemetry, Write

STATE_CODES: Mapping[KVPoll, int] = {
    KVPoll.PEER_LOST: 0,
    KVPoll.ABORTED: 1,
    KVPoll.FAILED: 2,
    KVPoll.BOOTSTRAPPING: 3,
    KVPoll.READY: 4,
    KVPoll.TRANSFERRING: 5,
    KVPoll.SUCCESS: 6,
}
STATES = {code: state for state, code in STATE_CODES.items()}
FOLLOWER_FAILED = "a tensor-parallel rank's push failed"
HELD_AUX_POLL_S = 0.002  # how soon the engine looks again while an aux row waits for followers


class MirrorOp(msgspec.Struct, array_like=True, frozen=True):
    """One sender call to repeat on every follower's backend (``kind``: create | pages | aux |
    fail | close | peer | bind; the fields each kind uses, the others left at their defaults;
    ``peer``: ``register``; ``bind``: ``agent_names`` and their ``wants``; ``pages``: a
    windowed sliding pool's entries of the same pages too, ``sliding_page_ids``: every rank
    holds the same, the step's plan gave them)."""

    kind: str
    room: int
    request_id: str = ""
    num_prompt_tokens: int = 0
    allowed_peer: str | None = None
    page_ids: list[int] = []
    first: int = 0  # pages: the first prompt page; aux: the aux row
    reason: str = ""
    register: wire.Register | None = None
    agent_names: list[str] = []
    wants: list[wire.Want | WindowWant] = []  # a hybrid SWA decode's names its window too
    sliding_page_ids: list[int] = []


@runtime_checkable
class Bound(Protocol):
    """A sender the followers can write beside (``PushSender``): it says which decode ranks
    it is bound to, and holds its statuses for the followers' writes too."""

    def bound(self) -> Sequence[tuple[Any, wire.Want]]:
        """(peer, want) per decode rank; a peer has ``agent_name`` and ``registration``."""
        ...

    def also_wait_for(self, writes: Write) -> None:
        """Writes of the room made elsewhere: a ``failed`` or ``aborted`` waits for them."""
        ...


@runtime_checkable
class DropsPeers(Protocol):
    """A backend that says when it dropped decode peers (``HubBackend``, ``DualBackend``)."""

    @property
    def num_dropped_peers(self) -> int:
        """Peers dropped so far: a change says some ``has_peer`` may have turned false."""
        ...

    def has_peer(self, agent_name: str) -> bool: ...


class Mirror(Protocol):
    """What carries ops to the followers and their states back (``tp.mirror.RankLink``)."""

    def mirror(self, op: MirrorOp) -> None: ...

    def followers_state(self, room: int) -> KVPoll | None:
        """The lowest state the followers reported for ``room``; None before they did."""
        ...

    def followers_settled(self, room: int) -> bool:
        """No follower's write of ``room`` can land any more: every follower said so after
        the room's fail or close reached it."""
        ...

    def sync(self) -> None:
        """Exchange what is queued now if the group is free (never waits for a forward)."""
        ...


def agree(states: Sequence[KVPoll]) -> KVPoll:
    """The group's state of a room: the lowest code over the ranks."""
    return STATES[min(STATE_CODES[state] for state in states)]


class FollowerWrites:
    """Every follower's writes of one room, as one ``Write`` the leader's sender waits for
    before a ``failed`` or ``aborted`` (module docstring). Each follower releases its own
    when the room's fail or close reaches it, so ``release`` has nothing to do here."""

    num_bytes = num_descs = 0  # not a write of the leader's agent: WriteSet counts none
    telemetry: Telemetry | None = None
    prep_s = 0.0
    prep_cpu_s = 0.0
    is_refused = False

    def __init__(self, room: int, mirror: Mirror) -> None:
        self._room, self._mirror = room, mirror

    def state(self) -> str:
        return "DONE" if self.is_settled else "PROC"

    def release(self) -> None:
        """The followers release their writes themselves (module docstring)."""

    @property
    def is_settled(self) -> bool:
        return self._mirror.followers_settled(self._room)


class GroupSender:
    def __init__(
        self, room: int, local: KVSender, mirror: Mirror, mirrored: dict[str, Any]
    ) -> None:
        self._room, self._local, self._mirror = room, local, mirror
        self._mirrored = mirrored  # the registration each follower holds, by agent name
        self._is_bound = False
        self.held_aux: int | None = None  # waits for the followers' writes

    def poll(self) -> KVPoll:
        self.release_aux()
        mine, theirs = self._local.poll(), self._mirror.followers_state(self._room)
        if theirs is None:
            return agree([mine, KVPoll.TRANSFERRING])
        return agree([mine, theirs])

    def num_cached_tokens(self) -> int:
        return self._local.num_cached_tokens()

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        self._local.send_pages(page_ids, first_page, sliding_page_ids)
        if not self._is_bound:
            self._is_bound = True
            self._mirror_bind()
        pages, sliding = list(page_ids), list(sliding_page_ids)
        op = MirrorOp(
            "pages", self._room, page_ids=pages, first=first_page, sliding_page_ids=sliding
        )
        self._mirror.mirror(op)

    def send_aux(self, aux_row: int) -> None:
        self._mirror.mirror(MirrorOp("aux", self._room, first=aux_row))
        self.held_aux = aux_row
        self.release_aux()

    def release_aux(self) -> None:
        """The aux row goes to the leader's sender once every follower's writes landed."""
        if self.held_aux is None:
            return
        if self._mirror.followers_state(self._room) is KVPoll.SUCCESS:
            aux_row, self.held_aux = self.held_aux, None
            self._local.send_aux(aux_row)

    def _mirror_bind(self) -> None:
        if not isinstance(self._local, Bound):
            return  # a protocol the followers write nothing for yet (module docstring)
        bound = self._local.bound()
        if any(peer.registration is None for peer, _ in bound):
            return  # a peer with no `register` (a TP-1 desk's): nothing to mirror
        names, wants = [], []
        for peer, want in bound:
            registration = peer.registration
            if registration is not None and self._mirrored.get(peer.agent_name) is not registration:
                self._mirrored[peer.agent_name] = registration
                self._mirror.mirror(MirrorOp("peer", self._room, register=registration))
            names.append(peer.agent_name)
            wants.append(want)
        self._mirror.mirror(MirrorOp("bind", self._room, agent_names=names, wants=wants))
        self._local.also_wait_for(FollowerWrites(self._room, self._mirror))

    def fail(self, reason: str) -> None:
        self.held_aux = None  # a failed room's aux row never goes, whatever the followers say
        self._local.fail(reason)
        self._mirror.mirror(MirrorOp("fail", self._room, reason=reason))

    def failure_reason(self) -> str | None:
        mine = self._local.failure_reason()
        if mine is None and self.poll() in (KVPoll.FAILED, KVPoll.PEER_LOST, KVPoll.ABORTED):
            return FOLLOWER_FAILED
        return mine

    def why_no_handshake(self) -> str | None:
        return self._local.why_no_handshake()

    def transfer_stats(self) -> TransferStats:
        return self._local.transfer_stats()  # this rank's writes (the others' are counted apart)

    def close(self) -> None:
        self.held_aux = None  # the row goes back to its pool now: it may be another's next
        self._local.close()
        self._mirror.mirror(MirrorOp("close", self._room))


class GroupBackend:
    """The leader's backend, every sender mirrored to the followers (module docstring)."""

    def __init__(self, local: TransferBackend, mirror: Mirror) -> None:
        self._local, self._mirror = local, mirror
        self._mirrored: dict[str, Any] = {}
        self._num_dropped = 0  # the local backend's num_dropped_peers when last looked at
        self._holding: dict[int, GroupSender] = {}  # senders whose aux row waits

    @property
    def bootstrap_endpoint(self) -> str:
        return self._local.bootstrap_endpoint

    @property
    def endpoints(self) -> Mapping[str, str]:
        return self._local.endpoints

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        """The leader's sender tells the decode (the followers' never do): only it carries
        ``traceparent``."""
        local = self._local.create_sender(
            room, request_id, num_prompt_tokens, allowed_peer, traceparent
        )
        op = MirrorOp("create", room, request_id, num_prompt_tokens, allowed_peer)
        self._mirror.mirror(op)
        sender = GroupSender(room, local, self._mirror, self._mirrored)
        self._holding[room] = sender
        return sender

    def poll(self) -> None:
        self._local.poll()
        self._mirror_drops()
        self._mirror.sync()
        for room, sender in list(self._holding.items()):
            sender.release_aux()
            if sender.held_aux is None and sender.poll().is_terminal:
                del self._holding[room]

    def take_claimed_rooms(self) -> Sequence[int]:
        """The leader's claims (a room whose followers' wants lag stays BOOTSTRAPPING: the
        engine looks at a claimed room's request each turn until it moves)."""
        return self._local.take_claimed_rooms()

    def _mirror_drops(self) -> None:
        """A ``drop`` of the mirrored decode ranks the local backend no longer has."""
        local = self._local
        if not isinstance(local, DropsPeers) or local.num_dropped_peers == self._num_dropped:
            return
        self._num_dropped = local.num_dropped_peers
        gone = [name for name in self._mirrored if not local.has_peer(name)]
        for name in gone:
            del self._mirrored[name]
        if gone:
            self._mirror.mirror(MirrorOp("drop", 0, agent_names=gone))

    def next_poll_at(self) -> float:
        at = self._local.next_poll_at()
        if any(s.held_aux is not None for s in self._holding.values()):
            return min(at, time.monotonic() + HELD_AUX_POLL_S)
        return at

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        self._local.wait(timeout_s, wake_fd)

    def close(self) -> None:
        self._local.close()
