"""The worker's side of the native bootstrap protocol: what each register, want, abort and
bye does.

``BootstrapDesk`` admits decode peers (``register``: checked, then added to NIXL under their
agent name, their pool's descriptor list prepared once) and hands wants and aborts to the
hub, which owns the tables. A decode rank of TP > 1 (``register.tp``) is checked against the
KV-head rule and its pool against ours with its heads only; when it holds a sub-range of our
heads its list addresses token runs of them (``transfer.headplan``), and its `registered`
names our TP layout. The leader of a TP group (``lead``) answers for the whole group: it
describes the model's every head, plans each decode rank's heads for its own rank (a decode
rank it does not feed still gets the aux row and the status from it), and its registrations
reach the other ranks through the group's mirror (``Peer.registration``). Every message is
checked (``validate``) before work is done for it; one that still raises refuses its peer,
is counted, and never leaves ``dispatch``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from msgspec import UNSET, structs

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import StateComponent, StateRegions, mismatch
from prefill_worker.transfer import wire
from prefill_worker.transfer.draft import DraftSide, pool_into
from prefill_worker.transfer.headplan import HeadSlice, decode_rank_error, plan_rank
from prefill_worker.transfer.native.bootstrap import BootstrapServer
from prefill_worker.transfer.native.dialect import UNKNOWN_PEER
from prefill_worker.transfer.native.draft import decode_draft
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, PreppedLists, prep_lists
from prefill_worker.transfer.nixl.rank_writer import RankPlace, prep_local_slice, prep_slice_lists
from prefill_worker.transfer.nixl.state_lists import StateLists, prep_state_list
from prefill_worker.transfer.push.hub import PushHub
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.window_route import full_pool_route
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    Refusal,
    RejectReason,
    check_register,
    check_want_size,
)

log = logging.getLogger(__name__)


class BootstrapDesk:
    """Answers bootstrap messages; the tables are the hub's."""

    def __init__(
        self,
        hub: PushHub[Peer],
        server: BootstrapServer,
        agent: Any,  # nixl_agent
        layout: KVLayout,
        limits: BootstrapLimits,
        described: wire.Described,  # this worker, as `describe` and `registered` name it
        run_on_agent: Callable[..., Any] = lambda fn, *args: fn(*args),
        regions: KVRegions | None = None,  # our pool, for decode ranks holding fewer heads
        state: StateComponent | None = None,  # a model with state: what a decode must hold
        draft: DraftSide | None = None,  # a draft model: its pool and rows (``native.draft``)
        sliding: SlidingLayers | None = None,  # a windowed sliding pool's layers (pool_pages)
    ) -> None:
        self._hub, self._server, self._agent = hub, server, agent
        self._sliding = sliding if sliding is not None and sliding.pool_pages else None
        self._state, self._draft = state, draft
        self._layout, self._limits, self._regions = layout, limits, regions
        self._described = described
        self._place = RankPlace(0, 1, layout.num_kv_heads)  # this worker's place: TP 1
        self._refused = hub.refusals.names  # registrations refused lately, by agent name
        self._run = run_on_agent  # where the agent lives (the transfer thread), waiting

    def lead(self, place: RankPlace) -> None:
        """Answer for a TP group whose rank ``place.rank`` this is: the pool a decode sees is
        the model's (every head), each decode rank written only the heads this rank feeds."""
        self._place = place
        self._layout = dataclasses.replace(self._layout, num_kv_heads=place.num_kv_heads)
        layout = wire.Layout.of(self._layout)
        compat = self._layout.compat_hash()
        self._described = structs.replace(self._described, layout=layout, compat_hash=compat)

    def dispatch(self, identity: bytes, msg: wire.Message | wire.WireError) -> None:
        """Answer one message; one that raises refuses its peer and never escapes."""
        try:
            self._dispatch(identity, msg)
        except Exception as exc:  # one peer's message must never stop the engine
            self._on_dispatch_error(identity, exc)

    # -- messages -----------------------------------------------------------------------

    def _dispatch(self, identity: bytes, msg: wire.Message | wire.WireError) -> None:
        peer = self._hub.peers.get(identity)
        if peer is not None:
            peer.last_seen = self._hub.clock()
        match msg:
            case wire.WireError():
                self._count(RejectReason.BAD_MESSAGE, f"bad message from a peer: {msg}")
                self._server.send(identity, wire.Reject(str(msg)))
            case wire.Register():
                self._register(identity, msg)
            case wire.Describe():  # no registration needed: a decode sizes its pool first
                self._server.send(identity, self._described)
            case wire.Want() | wire.Abort() | wire.Heartbeat() if peer is None:
                self._from_unknown(identity, msg)
            case wire.Want() if peer is not None:
                refusal = check_want_size(msg, self._layout, peer.regions.layout)
                if refusal is not None:
                    return self._hub.refuse_room(peer, msg.room, refusal)
                self._hub.want(peer, msg)
            case wire.Abort() if peer is not None:
                self._hub.abort(peer, msg.room)
            case wire.Bye() if peer is not None:
                self._hub.drop_peer(peer, "decode peer left")

    def _on_dispatch_error(self, identity: bytes, exc: Exception) -> None:
        reason = f"internal error on a bootstrap message: {exc!r}"[:300]
        self._count(RejectReason.INTERNAL_ERROR, reason, level=logging.ERROR)
        peer = self._hub.peers.get(identity)
        if peer is not None:
            self._hub.drop_peer(peer, reason)
        self._server.send(identity, wire.Reject(reason))

    def _register(self, identity: bytes, msg: wire.Register) -> None:
        """Everything is checked before an existing peer is touched; NIXL keys remote agents
        by name, so a peer under the same name is replaced only if it is this connection or
        its connection is gone (a send to it fails)."""
        rank = self._decode_rank(msg)
        if isinstance(rank, Refusal):
            return self._refuse(identity, rank, msg.agent_name)
        layout, head_slice, is_fed = rank
        refusal = check_register(msg, layout, self._limits) or self._windowed_refusal(msg)
        if refusal is not None:
            return self._refuse(identity, refusal, msg.agent_name)
        state = self._decode_state(msg)
        if isinstance(state, Refusal):
            return self._refuse(identity, state, msg.agent_name)
        regions = decode_draft(msg, self._draft)
        if isinstance(regions, Refusal):
            return self._refuse(identity, regions, msg.agent_name)
        peers = self._hub.peers
        holder = next((p for p in peers.values() if p.agent_name == msg.agent_name), None)
        if holder is not None and holder.identity != identity:
            if self._server.send(holder.identity, wire.Heartbeat()):
                why = f"agent name {msg.agent_name!r} is registered by another live connection"
                return self._refuse(identity, Refusal(RejectReason.NAME_TAKEN, why), None)
            self._hub.drop_peer(holder, "decode peer reconnected")
        if identity in peers:
            self._hub.drop_peer(peers[identity], "decode peer registered again")
        try:
            name = self._run(self._agent.add_remote_agent, wire.unframe_metadata(msg.metadata))
            name = name.decode() if isinstance(name, bytes) else name
        except NIXL_ERRORS as exc:
            why = f"NIXL refused: {exc}"
            return self._refuse(identity, Refusal(RejectReason.NIXL_REFUSED, why), msg.agent_name)
        if name != msg.agent_name:
            if all(p.agent_name != name for p in peers.values()):
                self._run(self._agent.remove_remote_agent, name)
            why = f"metadata names agent {name!r}, not {msg.agent_name!r}"
            return self._refuse(identity, Refusal(RejectReason.BAD_METADATA, why), msg.agent_name)
        try:
            lists = self._prep_lists(name, regions, head_slice if is_fed else None)
        except NIXL_ERRORS as exc:
            self._run(self._agent.remove_remote_agent, name)
            why = f"NIXL cannot address the decode pool: {exc}"
            return self._refuse(identity, Refusal(RejectReason.NIXL_REFUSED, why), msg.agent_name)
        try:
            state_lists = None if state is None else self._prep_state(name, state)
        except NIXL_ERRORS as exc:
            self._run(lists.release)
            self._run(self._agent.remove_remote_agent, name)
            why = f"NIXL cannot address the decode's state pool: {exc}"
            return self._refuse(identity, Refusal(RejectReason.NIXL_REFUSED, why), msg.agent_name)
        peer = Peer(identity, name, regions, lists, self._hub.clock(), head_slice=head_slice)
        peer.state = state_lists
        ours, theirs = self._layout, regions.layout  # full layers whole, sliding their window
        peer.route = full_pool_route(
            self._sliding, ours.num_pages, theirs.num_pages, ours.page_size, head_slice is None
        )
        peer.is_fed, peer.registration = is_fed, msg
        if msg.tp is not UNSET:
            peer.tp_rank, peer.tp_size = msg.tp.tp_rank, msg.tp.tp_size
        peers[identity] = peer
        self._refused.clear(name)
        self._server.send(identity, self._registered(None, msg.tp is not UNSET))
        log.info("bootstrap: decode peer %s registered", name)

    def _decode_rank(self, msg: wire.Register) -> tuple[KVLayout, HeadSlice | None, bool] | Refusal:
        """The pool layout a registering decode must have, the heads this rank writes into it
        (None: whole pages), and whether it writes any; a refusal when its rank breaks the
        KV-head rule."""
        place, num_kv_heads = self._place, self._layout.num_kv_heads
        if msg.tp is UNSET:
            if place.tp_size == 1:
                return self._layout, None, True
            tp_rank, tp_size = 0, 1
        else:
            tp_rank, tp_size = msg.tp.tp_rank, msg.tp.tp_size
            heads = range(msg.tp.head_start, msg.tp.head_stop)
            why = decode_rank_error(num_kv_heads, tp_rank, tp_size, heads)
            if why is not None:
                return Refusal(RejectReason.LAYOUT_MISMATCH, why)
        slices = plan_rank(num_kv_heads, place.rank, place.tp_size, tp_size)
        head_slice = next((s for s in slices if s.dst_rank == tp_rank), None)
        dst_heads = len(kv_head_range(num_kv_heads, tp_rank, tp_size))
        layout = dataclasses.replace(self._layout, num_kv_heads=dst_heads)
        if head_slice is None:
            return layout, None, False
        return layout, None if head_slice.is_whole_page else head_slice, True

    def _windowed_refusal(self, msg: wire.Register) -> Refusal | None:
        """A windowed sliding pool (``push.window_route``) feeds a decode of any TP size
        (whole pages or its head slices) but not a draft pool (its layers follow the
        target's in our lists, which the route does not address): refused by name."""
        if self._sliding is None or msg.draft is UNSET:
            return None
        return Refusal(
            RejectReason.UNSUPPORTED,
            "a decode with a draft pool: this worker keeps its sliding layers' window only "
            "(cache.sliding_pool windowed) and sends it to decodes without a draft; start "
            "the worker with sliding_pool full",
        )

    def _decode_state(self, msg: wire.Register) -> StateRegions | Refusal | None:
        """The decode's pool of our state component, as it registered it: None when this
        model has none or the decode registered none (its wants are then refused
        ``state_unsupported``); a refusal when it registered one we cannot write."""
        if self._state is None or msg.state is UNSET:
            return None
        pools = [p for p in msg.state if p.kind == self._state.kind]
        if len(pools) != 1:
            count = f"register names {len(pools)} {self._state.kind} state pools; one is needed"
            return Refusal(RejectReason.LAYOUT_MISMATCH, count)
        why = mismatch(self._state, pools[0].component)
        if why is not None:
            return Refusal(RejectReason.LAYOUT_MISMATCH, f"state layout mismatch: {why}")
        return pools[0].regions(msg.device)

    def _prep_state(self, name: str, regions: StateRegions) -> StateLists:
        return StateLists(regions, self._run(prep_state_list, self._agent, name, regions))

    def _prep_lists(
        self, name: str, regions: KVRegions, head_slice: HeadSlice | None
    ) -> PreppedLists:
        """The decode rank's lists (and, the first time a slice needs it, ours: token runs of
        the target's layers, or of the target's and the draft's for a decode that holds a
        draft pool)."""
        if head_slice is None:
            return self._run(prep_lists, self._agent, name, regions)
        assert self._regions is not None, "a desk that slices heads needs our regions"
        key = (head_slice.src_head_offset, head_slice.num_heads)
        local = self._hub.ctx.pages_into(regions).sliced  # a draft's layers too, if it has them
        if key not in local:
            draft = None if self._draft is None else self._draft.regions
            ours = pool_into(self._regions, draft, regions)
            local[key] = self._run(prep_local_slice, self._agent, ours, *key)
        args = (head_slice.dst_head_offset, head_slice.num_heads)
        return self._run(prep_slice_lists, self._agent, name, regions, *args)

    def _from_unknown(self, identity: bytes, msg: wire.Want | wire.Abort | wire.Heartbeat) -> None:
        """Nothing from an unregistered connection touches a room; it learns it is unknown."""
        match msg:
            case wire.Want(room=room):
                self._count(RejectReason.UNKNOWN_PEER, UNKNOWN_PEER, level=logging.DEBUG)
                status = wire.Status(room, "failed", UNKNOWN_PEER, RejectReason.UNKNOWN_PEER.value)
                self._server.send(identity, status)
            case wire.Abort(room=room):  # acknowledged, as unknown rooms are; nothing is done
                self._server.send(identity, wire.Status(room, "aborted", "aborted by decode"))
            case wire.Heartbeat():
                self._server.send(identity, wire.UnknownPeer(UNKNOWN_PEER))

    # -- refusals -----------------------------------------------------------------------

    def _count(self, reason: RejectReason, message: str, level: int = logging.WARNING) -> None:
        self._hub.counter.count(reason, message, level)

    def _refuse(self, identity: bytes, refusal: Refusal, agent_name: str | None) -> None:
        """Refuse a registration. Unless it claimed a name a live peer holds (``agent_name``
        None), rooms the router named for that agent fail with it now and for a while: that
        decode will never ask for them (``push.refusals``)."""
        self._count(refusal.reason, f"registration refused: {refusal.message}")
        self._server.send(identity, self._registered(refusal.message))
        peers = self._hub.peers.values()
        if agent_name is None or any(p.agent_name == agent_name for p in peers):
            return
        self._refused.add(agent_name, refusal.message, self._hub.clock())
        for sender in self._hub.senders.values():
            if sender.peer is None and sender.allowed_peer == agent_name:
                sender.fail(f"registration refused: {refusal.message}")

    def _registered(self, reason: str | None, has_tp: bool = False) -> wire.Registered:
        """The answer; with ``has_tp`` (the decode named its rank) our TP layout too."""
        described = self._described
        return wire.Registered(
            is_ok=reason is None,
            reason=reason,
            agent_name=described.agent_name,
            heartbeat_interval_s=described.heartbeat_interval_s,
            peer_timeout_s=described.peer_timeout_s,
            tp=self._worker_tp() if has_tp else UNSET,
        )

    def _worker_tp(self) -> wire.WorkerTP:
        """This worker's TP layout: each rank's heads; this bootstrap endpoint speaks for all."""
        place, endpoint = self._place, self._server.endpoint
        ranks = []
        for rank in range(place.tp_size):
            heads = kv_head_range(place.num_kv_heads, rank, place.tp_size)
            ranks.append(wire.WorkerRank(rank, heads.start, heads.stop, endpoint))
        return wire.WorkerTP(place.tp_size, tuple(ranks))
