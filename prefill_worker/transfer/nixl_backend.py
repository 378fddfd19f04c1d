"""The production transfer backend: NIXL WRITEs from this worker's KV pool into decode pools.

One agent per worker, progress thread off: ``poll()`` (engine loop) drains the bootstrap
server, drives every transfer, sends heartbeats and enforces deadlines. The KV pool and aux
rows are registered once; the local descriptor list is prepared once, and each decode
peer's list once at registration (``pagemap`` explains the index layout), so a chunk costs
one ``make_prepped_xfer`` with two index arrays.

Per request: ``send_pages`` posts one WRITE of K and V of the chunk's pages (adjacent pages
merge into single descriptors); ``send_aux`` asks for the aux row, posted once every page
write has landed, carrying a NIXL notification; when it lands the peer gets ``status ok``.
A peer silent past ``peer_timeout_s``, a write in flight past it, or a NIXL error fails the
request (the peer is told when reachable); handles are released, cancelling if need be.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.agent import NIXL_ERRORS, make_agent, register_regions
from prefill_worker.transfer.base import KVPoll, KVSender
from prefill_worker.transfer.bootstrap import BootstrapServer
from prefill_worker.transfer.nixl_sender import NixlSender, Peer, notif_tag
from prefill_worker.transfer.pagemap import descriptor_table, mem_type

log = logging.getLogger(__name__)


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
    ) -> None:
        self.regions = regions
        self.agent_name = agent_name
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.want_timeout_s = want_timeout_s
        self.clock = clock
        self._server = BootstrapServer(bootstrap_bind)  # first: a taken port fails fast
        self.bootstrap_endpoint = self._server.endpoint
        try:
            self.agent = make_agent(agent_name, nixl_backends)
            self._reg = register_regions(self.agent, regions)
            table = descriptor_table(regions)
            self.local_dlist = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", table, mem_type(regions.device)
            )
        except BaseException:
            self._server.close()
            raise
        self._peers: dict[bytes, Peer] = {}
        self._senders: dict[int, NixlSender] = {}  # room -> open sender
        self._unmatched: dict[int, tuple[bytes, wire.Want, float]] = {}  # room -> want
        self._gone: dict[int, tuple[str, float]] = {}  # room -> (why it failed, forget after)
        self._next_heartbeat = clock()

    # -- the TransferBackend seam -------------------------------------------------------

    def create_sender(self, room: int, request_id: str, num_prompt_tokens: int) -> KVSender:
        sender = NixlSender(self, room, request_id, num_prompt_tokens)
        if room in self._senders:
            sender.fail(f"bootstrap_room {room} is already in use")
            return sender
        self._senders[room] = sender
        self._gone.pop(room, None)
        if room in self._unmatched:
            identity, want, _ = self._unmatched.pop(room)
            self._bind(sender, identity, want)
        return sender

    def poll(self) -> None:
        for identity, msg in self._server.poll():
            self._dispatch(identity, msg)
        for sender in list(self._senders.values()):
            sender.progress()
        now = self.clock()
        self._expire(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval_s
            for identity in list(self._peers):
                self._server.send(identity, wire.Heartbeat())

    def close(self) -> None:
        for sender in list(self._senders.values()):
            sender.close()
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "prefill worker shutting down")
        self.local_dlist.release()
        self.agent.deregister_memory(self._reg)
        self._server.close()

    # -- for tests and metrics ----------------------------------------------------------

    @property
    def num_open_senders(self) -> int:
        return len(self._senders)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def num_inflight_transfers(self) -> int:
        return sum(s.num_inflight for s in self._senders.values())

    def check_integrity(self) -> None:
        for room, sender in self._senders.items():
            assert sender.room == room and not sender.is_closed
            assert sender.peer is None or sender.peer.identity in self._peers
        for peer in self._peers.values():
            assert all(self._senders[r].peer is peer for r in peer.rooms)

    # -- used by NixlSender -------------------------------------------------------------

    def send_status(self, sender: NixlSender, code: wire.StatusCode, reason: str | None) -> bool:
        if sender.peer is None:
            return False
        return self._server.send(sender.peer.identity, wire.Status(sender.room, code, reason))

    def forget(self, sender: NixlSender) -> None:
        """A closed sender leaves the tables; a late `want` for its room learns why."""
        if self._senders.get(sender.room) is sender:
            del self._senders[sender.room]
        if sender.peer is not None:
            sender.peer.rooms.discard(sender.room)
        elif sender.failure_reason() is not None and sender.room not in self._senders:
            self._gone[sender.room] = (
                sender.failure_reason() or "",
                self.clock() + self.want_timeout_s,
            )

    def drop_peer_of(self, sender: NixlSender, reason: str) -> None:
        """Last resort when a handle cannot be released: disconnecting cancels its writes."""
        if sender.peer is not None and sender.peer.identity in self._peers:
            self._drop_peer(sender.peer, reason)

    # -- the bootstrap protocol ---------------------------------------------------------

    def _dispatch(self, identity: bytes, msg: wire.Message | wire.WireError) -> None:
        peer = self._peers.get(identity)
        if peer is not None:
            peer.last_seen = self.clock()
        match msg:
            case wire.WireError():
                log.warning("bootstrap: bad message from a peer: %s", msg)
                self._server.send(identity, wire.Reject(str(msg)))
            case wire.Register():
                self._register(identity, msg)
            case wire.Want():
                self._want(identity, peer, msg)
            case wire.Abort():
                self._abort(identity, msg.room)
            case wire.Bye() if peer is not None:
                self._drop_peer(peer, "decode peer left")

    def _refuse(self, identity: bytes, reason: str) -> None:
        log.warning("bootstrap: registration refused: %s", reason)
        self._server.send(identity, self._registered(reason))

    def _registered(self, reason: str | None) -> wire.Registered:
        return wire.Registered(
            reason is None, reason, self.agent_name, self.heartbeat_interval_s, self.peer_timeout_s
        )

    def _register(self, identity: bytes, msg: wire.Register) -> None:
        ours, theirs = self.regions.layout, msg.regions.layout
        if msg.compat_hash != theirs.compat_hash() or theirs.compat_hash() != ours.compat_hash():
            return self._refuse(identity, f"KV layout mismatch: decode {theirs}, worker {ours}")
        try:
            metadata = wire.unframe_metadata(msg.metadata)
        except wire.WireError as exc:
            return self._refuse(identity, str(exc))
        for old in [
            p
            for p in self._peers.values()
            if p.identity == identity or p.agent_name == msg.agent_name
        ]:
            self._drop_peer(old, "decode peer registered again")
        try:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
        except NIXL_ERRORS as exc:
            return self._refuse(identity, f"NIXL refused the metadata: {exc}")
        if name != msg.agent_name:
            self.agent.remove_remote_agent(name)
            return self._refuse(identity, f"metadata names agent {name!r}, not {msg.agent_name!r}")
        try:
            table = descriptor_table(msg.regions)
            dlist = self.agent.prep_xfer_dlist(name, table, mem_type(msg.regions.device))
        except NIXL_ERRORS as exc:
            self.agent.remove_remote_agent(name)
            return self._refuse(identity, f"NIXL cannot address the decode pool: {exc}")
        self._peers[identity] = Peer(identity, name, msg.regions, dlist, self.clock())
        self._server.send(identity, self._registered(None))
        log.info("bootstrap: decode peer %s registered", name)

    def _want(self, identity: bytes, peer: Peer | None, want: wire.Want) -> None:
        room, sender = want.room, self._senders.get(want.room)
        if peer is None:
            self._server.send(identity, wire.Status(room, "failed", "decode peer not registered"))
        elif room in self._unmatched or (sender is not None and sender.peer is not None):
            self._server.send(identity, wire.Status(room, "failed", f"duplicate want for {room}"))
        elif sender is not None:
            self._bind(sender, identity, want)
        elif room in self._gone:
            self._server.send(identity, wire.Status(room, "failed", self._gone.pop(room)[0]))
        else:
            self._unmatched[room] = (identity, want, self.clock() + self.want_timeout_s)

    def _bind(self, sender: NixlSender, identity: bytes, want: wire.Want) -> None:
        peer = self._peers.get(identity)
        if peer is None:  # left between its want and our request
            return sender.fail("decode peer left before the request arrived")
        sender.bind(peer, want)
        if sender.poll() is KVPoll.READY:
            peer.rooms.add(sender.room)

    def _abort(self, identity: bytes, room: int) -> None:
        sender = self._senders.get(room)
        if sender is not None and sender.peer is not None and sender.peer.identity == identity:
            sender.abort_by_peer()
            return
        self._unmatched.pop(room, None)
        self._server.send(identity, wire.Status(room, "aborted", "aborted by decode"))

    # -- liveness -----------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if now - peer.last_seen > self.peer_timeout_s:
                self._drop_peer(peer, f"decode peer silent for over {self.peer_timeout_s:g} s")
        for room, (identity, _, deadline) in list(self._unmatched.items()):
            if now >= deadline:
                del self._unmatched[room]
                reason = "prefill request never arrived"
                self._server.send(identity, wire.Status(room, "failed", reason))
        for room, (_, deadline) in list(self._gone.items()):
            if now >= deadline:
                del self._gone[room]

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        """Fail every request bound to the peer, cancel its writes, forget its agent."""
        level = logging.INFO if peer.rooms else logging.DEBUG
        log.log(level, "bootstrap: dropping decode peer %s: %s", peer.agent_name, reason)
        del self._peers[peer.identity]
        for sender in [s for s in self._senders.values() if s.peer is peer]:
            sender.lose_peer(reason)
        for room, (identity, _, _) in list(self._unmatched.items()):
            if identity == peer.identity:
                del self._unmatched[room]
        peer.rooms.clear()
        peer.dlist.release()
        try:
            self.agent.remove_remote_agent(peer.agent_name)
        except NIXL_ERRORS as exc:
            log.warning("bootstrap: removing agent %s: %s", peer.agent_name, exc)


__all__ = ["NixlBackend", "notif_tag"]
