"""The worker's side of the bootstrap protocol: what each register, want, abort and bye does.

``BootstrapDesk`` admits decode peers (``register``: checked, then added to NIXL under their
agent name, their pool's descriptor list prepared once), matches wants to rooms, and refuses
what it must, counting every refusal. It shares the backend's peer and sender tables and
does no transfer work: dropping a peer (which fails its requests and drains their statuses)
is the backend's, handed in as ``drop_peer``.

Fault isolation: every message is checked (``validate``) before work is done for it; one
that still raises refuses its peer, is counted, and never leaves ``dispatch``. Rooms are
capabilities: a room is bound once, to the first acceptable ``want``; when the router named
the decode peer (``allowed_peer``) only that agent's ``want`` is acceptable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prefill_worker.kv.layout import KVLayout
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.bootstrap import BootstrapServer
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, prep_lists
from prefill_worker.transfer.nixl.context import Peer
from prefill_worker.transfer.nixl.sender import NixlSender
from prefill_worker.transfer.refused_names import RefusedNames
from prefill_worker.transfer.rooms import RoomBook
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    Refusal,
    RejectReason,
    check_register,
    check_want_size,
    duplicate_want,
    foreign_room,
)

log = logging.getLogger(__name__)

UNKNOWN_PEER = "decode peer not registered"


class BootstrapDesk:
    """Answers bootstrap messages against the peer, sender and room tables it shares."""

    def __init__(
        self,
        server: BootstrapServer,
        agent: Any,  # nixl_agent
        layout: KVLayout,
        limits: BootstrapLimits,
        tables: tuple[dict[bytes, Peer], dict[int, NixlSender], RoomBook],
        drop_peer: Callable[[Peer, str], None],
        clock: Callable[[], float],
        *,
        agent_name: str,
        heartbeat_interval_s: float,
        peer_timeout_s: float,
        want_timeout_s: float,
        on_reject: Callable[[str], None],
        refused: RefusedNames,
        run_on_agent: Callable[..., Any] = lambda fn, *args: fn(*args),
    ) -> None:
        self._server = server
        self._refused = refused
        self._agent = agent
        self._layout = layout
        self._limits = limits
        self._peers, self._senders, self._rooms = tables
        self._drop_peer = drop_peer
        self._clock = clock
        self._agent_name = agent_name
        self._heartbeat_interval_s = heartbeat_interval_s
        self._peer_timeout_s = peer_timeout_s
        self._want_timeout_s = want_timeout_s
        self._on_reject = on_reject
        self._run = run_on_agent  # where the agent lives (the transfer thread), waiting
        self.reject_counts: dict[str, int] = {}

    def dispatch(self, identity: bytes, msg: wire.Message | wire.WireError) -> None:
        """Answer one message; one that raises refuses its peer and never escapes."""
        try:
            self._dispatch(identity, msg)
        except Exception as exc:  # one peer's message must never stop the engine
            self._on_dispatch_error(identity, exc)

    def refuse_room(self, identity: bytes, room: int, refusal: Refusal) -> None:
        self._count(refusal.reason, refusal.message, level=logging.DEBUG)  # rooms stay private
        status = wire.Status(room, "failed", refusal.message, refusal.reason.value)
        self._server.send(identity, status)

    @staticmethod
    def why_not(sender: NixlSender, peer: Peer) -> Refusal:
        if not sender.accepts(peer.agent_name):
            return foreign_room(sender.room)
        return duplicate_want(sender.room)

    def bind(self, sender: NixlSender, peer: Peer, want: wire.Want) -> None:
        sender.bind(peer, want)
        if sender.poll() is KVPoll.READY:
            peer.rooms.add(sender.room)

    # -- messages -----------------------------------------------------------------------

    def _dispatch(self, identity: bytes, msg: wire.Message | wire.WireError) -> None:
        peer = self._peers.get(identity)
        if peer is not None:
            peer.last_seen = self._clock()
        match msg:
            case wire.WireError():
                self._count(RejectReason.BAD_MESSAGE, f"bad message from a peer: {msg}")
                self._server.send(identity, wire.Reject(str(msg)))
            case wire.Register():
                self._register(identity, msg)
            case wire.Describe():  # no registration needed: a decode sizes its pool first
                self._server.send(identity, self._described())
            case wire.Want() | wire.Abort() | wire.Heartbeat() if peer is None:
                self._from_unknown(identity, msg)
            case wire.Want() if peer is not None:
                self._want(peer, msg)
            case wire.Abort() if peer is not None:
                self._abort(peer, msg.room)
            case wire.Bye() if peer is not None:
                self._drop_peer(peer, "decode peer left")

    def _on_dispatch_error(self, identity: bytes, exc: Exception) -> None:
        reason = f"internal error on a bootstrap message: {exc!r}"[:300]
        self._count(RejectReason.INTERNAL_ERROR, reason, level=logging.ERROR)
        peer = self._peers.get(identity)
        if peer is not None:
            self._drop_peer(peer, reason)
        self._server.send(identity, wire.Reject(reason))

    def _register(self, identity: bytes, msg: wire.Register) -> None:
        """Everything is checked before an existing peer is touched; NIXL keys remote agents
        by name, so a peer under the same name is replaced only if it is this connection or
        its connection is gone (a send to it fails)."""
        refusal = check_register(msg, self._layout, self._limits)
        if refusal is not None:
            return self._refuse(identity, refusal, msg.agent_name)
        holder = next((p for p in self._peers.values() if p.agent_name == msg.agent_name), None)
        if holder is not None and holder.identity != identity:
            if self._server.send(holder.identity, wire.Heartbeat()):
                why = f"agent name {msg.agent_name!r} is registered by another live connection"
                return self._refuse(identity, Refusal(RejectReason.NAME_TAKEN, why), None)
            self._drop_peer(holder, "decode peer reconnected")
        if identity in self._peers:
            self._drop_peer(self._peers[identity], "decode peer registered again")
        try:
            name = self._run(self._agent.add_remote_agent, wire.unframe_metadata(msg.metadata))
            name = name.decode() if isinstance(name, bytes) else name
        except NIXL_ERRORS as exc:
            why = f"NIXL refused: {exc}"
            return self._refuse(identity, Refusal(RejectReason.NIXL_REFUSED, why), msg.agent_name)
        if name != msg.agent_name:
            if all(p.agent_name != name for p in self._peers.values()):
                self._run(self._agent.remove_remote_agent, name)
            why = f"metadata names agent {name!r}, not {msg.agent_name!r}"
            return self._refuse(identity, Refusal(RejectReason.BAD_METADATA, why), msg.agent_name)
        try:
            lists = self._run(prep_lists, self._agent, name, msg.regions)
        except NIXL_ERRORS as exc:
            self._run(self._agent.remove_remote_agent, name)
            why = f"NIXL cannot address the decode pool: {exc}"
            return self._refuse(identity, Refusal(RejectReason.NIXL_REFUSED, why), msg.agent_name)
        self._peers[identity] = Peer(identity, name, msg.regions, lists, self._clock())
        self._refused.clear(name)
        self._server.send(identity, self._registered(None))
        log.info("bootstrap: decode peer %s registered", name)

    def _from_unknown(self, identity: bytes, msg: wire.Want | wire.Abort | wire.Heartbeat) -> None:
        """Nothing from an unregistered connection touches a room; it learns it is unknown."""
        match msg:
            case wire.Want(room=room):
                self.refuse_room(identity, room, Refusal(RejectReason.UNKNOWN_PEER, UNKNOWN_PEER))
            case wire.Abort(room=room):  # acknowledged, as unknown rooms are; nothing is done
                self._server.send(identity, wire.Status(room, "aborted", "aborted by decode"))
            case wire.Heartbeat():
                self._server.send(identity, wire.UnknownPeer(UNKNOWN_PEER))

    def _want(self, peer: Peer, want: wire.Want) -> None:
        room, sender = want.room, self._senders.get(want.room)
        refusal = check_want_size(want, self._layout, peer.regions.layout)
        if refusal is not None:
            return self.refuse_room(peer.identity, room, refusal)
        if sender is not None:
            if sender.peer is not None or not sender.accepts(peer.agent_name):
                return self.refuse_room(peer.identity, room, self.why_not(sender, peer))
            return self.bind(sender, peer, want)
        gone = self._rooms.gone(room)
        if gone is not None:
            if gone.allowed_peer not in (None, peer.agent_name):
                return self.refuse_room(peer.identity, room, foreign_room(room))
            self._rooms.forget_gone(room)
            self._server.send(peer.identity, wire.Status(room, "failed", gone.reason))
            return None
        self._claim(peer, want)

    def _claim(self, peer: Peer, want: wire.Want) -> None:
        refusal = self._rooms.claim(peer, want, self._clock() + self._want_timeout_s)
        if refusal is not None:
            self.refuse_room(peer.identity, want.room, refusal)

    def _abort(self, peer: Peer, room: int) -> None:
        """Only the owner's abort acts; any other is acknowledged and changes nothing."""
        sender = self._senders.get(room)
        if sender is not None and sender.peer is peer:
            sender.abort_by_peer()
            return
        if self._rooms.drop(room, peer):  # its want was waiting: the request may still come
            self._rooms.mark_aborted(room, peer.agent_name, self._clock() + self._want_timeout_s)
        self._server.send(peer.identity, wire.Status(room, "aborted", "aborted by decode"))

    # -- refusals -----------------------------------------------------------------------

    def _count(self, reason: RejectReason, message: str, level: int = logging.WARNING) -> None:
        self.reject_counts[reason.value] = self.reject_counts.get(reason.value, 0) + 1
        self._on_reject(reason.value)
        log.log(level, "bootstrap: %s: %s", reason.value, message)

    def _refuse(self, identity: bytes, refusal: Refusal, agent_name: str | None) -> None:
        """Refuse a registration. Unless it claimed a name a live peer holds (``agent_name``
        None), rooms the router named for that agent fail with it now and for a while
        (``transfer/refused_names.py``): that decode will never ask for them."""
        self._count(refusal.reason, f"registration refused: {refusal.message}")
        self._server.send(identity, self._registered(refusal.message))
        if agent_name is None or any(p.agent_name == agent_name for p in self._peers.values()):
            return
        self._refused.add(agent_name, refusal.message, self._clock())
        for sender in self._senders.values():
            if sender.peer is None and sender.allowed_peer == agent_name:
                sender.fail(f"registration refused: {refusal.message}")

    def _described(self) -> wire.Described:
        return wire.Described(
            agent_name=self._agent_name,
            layout=wire.Layout.of(self._layout),
            compat_hash=self._layout.compat_hash(),
            heartbeat_interval_s=self._heartbeat_interval_s,
            peer_timeout_s=self._peer_timeout_s,
        )

    def _registered(self, reason: str | None) -> wire.Registered:
        return wire.Registered(
            is_ok=reason is None,
            reason=reason,
            agent_name=self._agent_name,
            heartbeat_interval_s=self._heartbeat_interval_s,
            peer_timeout_s=self._peer_timeout_s,
        )
