"""What each SGLang control message does, mapped onto the engine's vocabulary: a
registration is a peer, a transfer request is a ``want`` (``decode_prefix_len`` is the prefix
the decode holds), an ABORT is the peer's abort of a room; the hub does what both protocols do.

Everything is checked before NIXL sees it (``sglang.accept``; a hybrid model's state pool
by its kind, ``sglang.components``: a hybrid SWA pool, a DSA index pool, a mamba pool). SGLang
has no answer to a registration, so a refused decode learns why on its first request
(reasons kept per agent name, bounded); that request also fails the room's own request, now
or when it comes.

Identity: a PULL socket's frame names its sender (agent name, ``ip:port``) and nothing in it
proves that. The ip a frame names must be its connection's, and in
``transfer.sglang_allowed_networks`` when set (else the frame is dropped and counted); a live
registration keeps its ``ip:port`` against any other agent; a request may name only the agent
registered at its own ``ip:port`` (docs/sglang.md, "Identity"). Rooms stay secret (never
logged at INFO).

The leader of a TP group (``lead``) answers for every rank: ``/route`` names its control
socket for each, so every decode rank registers and asks here; this desk plans what rank 0
writes into each decode rank, and keeps the registration (as a native `register`) for the
group's mirror, which has the other ranks write their heads (docs/sglang.md, "Workers with
TP > 1"). An MLA decode of attention TP d < p reads its latent from one worker rank (the
first it targets, the one ``headplan`` has write it) and sends the others a dummy request:
SGLang's dummy rank writes nothing and sends no status, and so does this desk (a dummy holds
nothing: the real request, a copy to the same leader, carries the room); the decode hears
one ``KV_STATUS`` and, for an ABORT, one ``ABORT_ACK`` per rank it asked (``dialect``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from msgspec import UNSET, UnsetType

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import MLA, KVLayout, KVRegions
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.draft import pool_into
from prefill_worker.transfer.headplan import HeadSlice, slice_table
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, PreppedLists
from prefill_worker.transfer.nixl.rank_writer import prep_local_slice
from prefill_worker.transfer.nixl.state_lists import StateLists, prep_state_list
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE, kv_descriptor_table, mem_type
from prefill_worker.transfer.push.hub import PushHub
from prefill_worker.transfer.push.refusals import ExpiringTable, RefusedRoom
from prefill_worker.transfer.sglang import aux, frames
from prefill_worker.transfer.sglang.accept import (
    Network,
    check_registration,
    check_request,
    check_source,
    num_draft_entries,
    peer_regions,
    rank_slice,
    status_ranks,
    target_ranks,
)
from prefill_worker.transfer.sglang.components import StateComponents
from prefill_worker.transfer.sglang.control import ReplySockets
from prefill_worker.transfer.sglang.dialect import SglangPeer
from prefill_worker.transfer.swa_window import SWA_KIND, swa_pool_regions
from prefill_worker.transfer.validate import BootstrapLimits, Refusal, RejectReason, check_want_size

log = logging.getLogger(__name__)

NOT_REGISTERED = "decode not registered with this prefill worker"
_MAX_REFUSED = 1024  # refusal reasons remembered, by agent name


class SglangDesk:
    """Answers SGLang control messages; the tables are the hub's."""

    def __init__(
        self,
        hub: PushHub[SglangPeer],
        agent: Any,  # nixl_agent
        replies: ReplySockets,
        layout: KVLayout,
        limits: BootstrapLimits,
        is_rejoining: Callable[[], bool] = lambda: False,
        run_on_agent: Callable[..., Any] = lambda fn, *args: fn(*args),
        allowed_networks: Sequence[Network] = (),
        regions: KVRegions | None = None,  # our pool, for decode ranks holding fewer heads
        draft: KVRegions | None = None,  # a draft model's pool (``transfer.draft``)
        components: StateComponents | None = None,  # the model's state kind (None: no state)
    ) -> None:
        self._hub, self._agent, self._replies = hub, agent, replies
        self._draft = draft
        self._num_draft_layers = 0 if draft is None else draft.layout.num_layers
        self._regions = regions
        self._allowed_networks = tuple(allowed_networks)
        self._run = run_on_agent  # where the agent lives (the transfer thread), waiting
        self._layout, self._limits = layout, limits
        # Why registrations were refused, by agent name: a decode hears it on each request.
        self._refused: ExpiringTable[str, str] = ExpiringTable(math.inf, _MAX_REFUSED)
        # Rooms such a decode asked for before their request came: that request fails at once.
        self._refused_rooms = hub.refusals.rooms
        self._is_rejoining = is_rejoining  # the rejoin window after start (``backend``)
        self._prefill_tp = 1  # this worker's TP size (``lead``)
        self._components = components or StateComponents(agent, limits, run_on_agent)

    def lead(self, tp_size: int, num_kv_heads: int) -> None:
        """Answer for a TP group of ``tp_size`` ranks whose leader (rank 0) this is: a decode
        sees the model's every head, each decode rank is written rank 0's part here and the
        rest by the other ranks (module docstring)."""
        self._prefill_tp = tp_size
        self._layout = dataclasses.replace(self._layout, num_kv_heads=num_kv_heads)

    def dispatch(self, message: frames.Message | frames.FrameError, source_ip: str) -> None:
        """Answer one message that came on a connection from ``source_ip``; one that raises
        is counted and never escapes."""
        try:
            if not isinstance(message, frames.FrameError) and not self._is_from(message, source_ip):
                return
            match message:
                case frames.FrameError():
                    self._count(RejectReason.BAD_MESSAGE, f"unreadable control frame: {message}")
                case frames.Registration():
                    self._register(message)
                case frames.TransferRequest():
                    self._request(message)
                case frames.AbortNotice():
                    self._abort(message)
        except Exception as exc:  # one decode's message must never stop the engine
            self._count(RejectReason.INTERNAL_ERROR, f"on a control message: {exc!r}"[:300])

    def _refuse_unknown(self, endpoint: frames.Endpoint, room: int, refusal: Refusal) -> None:
        """Refuse a request from an address no registered peer holds."""
        self._count(refusal.reason, refusal.message, level=logging.DEBUG)  # rooms stay private
        self._replies.send(endpoint, frames.kv_status(room, False, refusal.message))

    def _is_from(self, message: frames.Message, source_ip: str) -> bool:
        refusal = check_source(message.endpoint, source_ip, self._allowed_networks)
        if refusal is not None:
            self._count(refusal.reason, f"{type(message).__name__} dropped: {refusal.message}")
        return refusal is None

    # -- registration -------------------------------------------------------------------

    def _register(self, reg: frames.Registration) -> None:
        accepted = self._components.accept(reg, self._layout)  # its state pool split off
        if isinstance(accepted, Refusal):
            return self._refuse(reg.agent_name, accepted)
        reg, layout, state = accepted.registration, accepted.layout, accepted.state
        refusal = check_registration(
            reg, layout, self._limits, self._prefill_tp, self._num_draft_layers
        )
        if refusal is not None:
            return self._refuse(reg.agent_name, refusal)
        head_slice = rank_slice(reg, layout, self._prefill_tp)
        sliced = None if head_slice is None or head_slice.is_whole_page else head_slice
        # its state pool in other heads than ours
        refusal = None if sliced is None else self._components.refuse_slices(state)
        if refusal is not None:
            return self._refuse(reg.agent_name, refusal)
        held = self._hub.peers.get(reg.agent_name.encode())
        if held is not None:  # SGLang registers once per prefill; a repeat changes nothing
            if held.regions != peer_regions(reg, layout, self._num_draft_layers):
                why = f"agent {reg.agent_name!r} is registered with another pool"
                self._count(RejectReason.NAME_TAKEN, why)
            return None
        refusal = self._take_address(reg)
        if refusal is not None:
            return self._refuse(reg.agent_name, refusal)
        try:
            name = self._run(self._agent.add_remote_agent, reg.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
        except NIXL_ERRORS as exc:
            return self._refuse(reg.agent_name, Refusal(RejectReason.NIXL_REFUSED, f"{exc}"))
        if name != reg.agent_name:
            self._run(self._agent.remove_remote_agent, name)
            why = f"metadata names agent {name!r}, not {reg.agent_name!r}"
            return self._refuse(reg.agent_name, Refusal(RejectReason.BAD_METADATA, why))
        regions = peer_regions(reg, layout, self._num_draft_layers)
        try:
            lists, prepped = self._run(self._prep, name, regions, reg.aux_ptrs, sliced, state)
        except NIXL_ERRORS as exc:
            self._run(self._agent.remove_remote_agent, name)
            why = f"NIXL cannot address the decode's buffers: {exc}"
            return self._refuse(name, Refusal(RejectReason.NIXL_REFUSED, why))
        now, identity = self._hub.clock(), name.encode()
        peer = SglangPeer(
            identity,
            name,
            regions,
            lists,
            now,
            tp_rank=reg.tp_rank,
            tp_size=reg.tp_size,
            head_slice=sliced,
            is_fed=head_slice is not None,
            registration=self._for_group(reg, regions, state),
            aux_ptrs=reg.aux_ptrs,
            endpoint=reg.endpoint,
            prefill_ranks=target_ranks(reg.tp_rank, reg.tp_size, self._prefill_tp),
            status_ranks=status_ranks(reg.tp_rank, reg.tp_size, self._prefill_tp, self._is_mla),
            state=prepped,
            local_state=accepted.share,
            route=self._components.route(self._layout, regions, prepped, sliced is None),
            num_draft_entries=num_draft_entries(reg, layout),
        )
        self._hub.peers[identity] = peer
        self._refused.clear(name)
        log.info("sglang: decode %s registered (%d pages)", name, regions.layout.num_pages)

    def _for_group(
        self, reg: frames.Registration, regions: KVRegions, state: StateRegions | None
    ) -> wire.Register | None:
        """The decode rank as a native `register`, which the group's mirror hands the other
        ranks (their own NIXL agents write their heads into it); None at TP 1. A hybrid SWA
        pool goes with it (each rank writes its heads of the window there too); the other
        kinds' pools are the leader's alone to write."""
        if self._prefill_tp == 1:
            return None
        heads = kv_head_range(self._layout.num_kv_heads, reg.tp_rank, reg.tp_size)
        rank = wire.DecodeRank(reg.tp_rank, reg.tp_size, heads.start, heads.stop)
        metadata = wire.frame_metadata(reg.agent_metadata)
        pools: tuple[wire.StatePool, ...] | UnsetType = UNSET
        if state is not None and state.component.kind == SWA_KIND:
            pools = (wire.StatePool.of(state.component, state.base_addrs),)
        return wire.Register.of(reg.agent_name, metadata, regions, "sglang", rank, pools)

    def _take_address(self, reg: frames.Registration) -> Refusal | None:
        """A live decode keeps its ``ip:port``: another agent registering there is refused.
        A holder with no room, no waiting request and nothing heard for ``want_timeout_s``
        is taken for a decode that restarted on the same port, and dropped."""
        for old in [p for p in self._hub.peers.values() if p.endpoint == reg.endpoint]:
            if old.rooms or old.unmatched or not self._is_idle(old):
                where = f"{reg.endpoint.host}:{reg.endpoint.port}"
                why = f"{where} is registered by live agent {old.agent_name!r}"
                return Refusal(RejectReason.ADDRESS_TAKEN, why)
            self._hub.drop_peer(old, "decode re-registered under a new agent name")
        return None

    def _is_idle(self, peer: SglangPeer) -> bool:
        return self._hub.clock() - peer.last_seen >= self._hub.want_timeout_s

    def _prep(
        self,
        name: str,
        regions: KVRegions,
        aux_ptrs: tuple[int, ...],
        head_slice: HeadSlice | None,
        state: StateRegions | None = None,
    ) -> tuple[PreppedLists, StateLists | None]:
        """The decode pool's descriptor list, once (token runs of its heads when it holds part
        of ours, and ours of the same heads the first time); row 0 of each metadata buffer,
        which NIXL checks against what the decode registered (rows are written per request);
        and its state pool's (a hybrid SWA pool, a DSA index pool, a mamba pool), when it has
        one. Runs where the agent lives."""
        if head_slice is None:
            table = kv_descriptor_table(regions)
        else:  # a hybrid SWA decode's KV list is of the full layers: our pool is routed whole
            is_swa = state is not None and state.component.kind == SWA_KIND
            self._prep_local(head_slice, None if is_swa else regions)
            table = slice_table(regions, head_slice.dst_head_offset, head_slice.num_heads)
        kv = self._agent.prep_xfer_dlist(name, table, mem_type(regions.device))
        lists = None
        try:
            first_rows = aux.remote_descs(aux_ptrs, 0).astype(np.uint64)
            lists = PreppedLists(kv, self._agent.prep_xfer_dlist(name, first_rows, AUX_MEM_TYPE))
            if state is None:
                return lists, None
            if head_slice is not None and state.component.kind == SWA_KIND:
                # a hybrid SWA pool of more heads than ours: our heads' token runs of it
                slices = slice_table(
                    swa_pool_regions(state), head_slice.dst_head_offset, head_slice.num_heads
                )
                swa = self._agent.prep_xfer_dlist(name, slices, mem_type(state.device))
                return lists, StateLists(state, swa)
            return lists, StateLists(state, prep_state_list(self._agent, name, state))
        except BaseException:
            (kv if lists is None else lists).release()
            raise

    def release_shares(self) -> None:
        """The staged shares' lists (at close, before the agent)."""
        self._components.release()

    def _prep_local(self, head_slice: HeadSlice, remote: KVRegions | None) -> None:
        """Our token runs of the slice's heads, once: of the target's layers, or of the
        target's and the draft's for a decode that holds a draft pool (``remote``); None:
        of our pool's layers (a route picks its pages: ``sglang.swa``)."""
        assert self._regions is not None, "a desk that slices heads needs our regions"
        key = (head_slice.src_head_offset, head_slice.num_heads)
        ctx = self._hub.ctx
        local = ctx.pages.sliced if remote is None else ctx.pages_into(remote).sliced
        if key not in local:
            ours = (
                self._regions if remote is None else pool_into(self._regions, self._draft, remote)
            )
            local[key] = prep_local_slice(self._agent, ours, *key)

    def _refuse(self, agent_name: str, refusal: Refusal) -> None:
        self._count(refusal.reason, f"registration of {agent_name} refused: {refusal.message}")
        why = f"registration refused: {refusal.message}"
        self._refused.add(agent_name, why, self._hub.clock())

    # -- requests and aborts ------------------------------------------------------------

    def _request(self, req: frames.TransferRequest) -> None:
        peer = self._hub.peers.get(req.agent_name.encode())
        if peer is None:
            return self._request_from_unknown(req)
        if peer.endpoint != req.endpoint:  # its own agent only: the one at its ip:port
            why = f"agent {req.agent_name!r} is registered from another address"
            foreign = Refusal(RejectReason.FOREIGN_AGENT, why)
            return self._refuse_unknown(req.endpoint, req.room, foreign)
        peer.last_seen = self._hub.clock()
        if peer.tp_size < self._prefill_tp and self._is_copy(peer, req.room):
            return None
        want, req = self._components.want(req, peer)  # its state indices read (``components``)
        refusal = check_request(req, peer.tp_size, self._prefill_tp, self._is_mla)
        if refusal is None and req.is_dummy:
            return None  # the real request carries the room (the module docstring)
        if isinstance(want, Refusal):
            return self._hub.refuse_room(peer, req.room, want)
        refusal = refusal or check_want_size(want, self._layout, peer.regions.layout)
        if refusal is not None:
            return self._hub.refuse_room(peer, req.room, refusal)
        self._hub.want(peer, want)

    @property
    def _is_mla(self) -> bool:
        return self._layout.kind == MLA

    def _is_copy(self, peer: SglangPeer, room: int) -> bool:
        """A decode rank of TP d < p sends each request to each of the p / d prefill ranks
        it targets (all this leader): the copies after the first change nothing."""
        sender = self._hub.senders.get(room)
        return room in peer.unmatched or (sender is not None and peer in sender.peers)

    def _request_from_unknown(self, req: frames.TransferRequest) -> None:
        """A decode this run does not know: refused, or one that knew the previous run. In the
        rejoin window the latter gets no answer: its heartbeat is about to drop that run and
        fail the room ("Lost connection"), and its router retries once it has registered
        afresh; a failure now would only send the router's retries into the same wall (smg
        opens its circuit breaker after ten)."""
        why = self._refused.get(req.agent_name, self._hub.clock())
        if why is None and self._is_rejoining():
            return self._count(RejectReason.UNKNOWN_PEER, "during the rejoin window", logging.DEBUG)
        why = why or NOT_REGISTERED
        self._fail_waiting_room(req.room, req.agent_name, why)
        self._refuse_unknown(req.endpoint, req.room, Refusal(RejectReason.UNKNOWN_PEER, why))

    def _fail_waiting_room(self, room: int, agent_name: str, why: str) -> None:
        """The room's request fails with the decode's refusal: now if it waits unbound for
        this decode, else when it comes."""
        sender = self._hub.senders.get(room)
        if sender is None:
            self._refused_rooms.add(room, RefusedRoom(agent_name, why), self._hub.clock())
        elif sender.peer is None and sender.accepts(agent_name):
            sender.fail(why)

    def _abort(self, notice: frames.AbortNotice) -> None:
        """An ABORT names its sender by its control socket: only the owner's acts; every ABORT
        is acknowledged (the owner's after the room's writes)."""
        peers = self._hub.peers.values()
        peer = next((p for p in peers if p.endpoint == notice.endpoint), None)
        if peer is not None:
            return self._hub.abort(peer, notice.room, notice.generation)
        self._replies.send(notice.endpoint, frames.abort_ack(notice.room, notice.generation))

    def _count(self, reason: RejectReason, message: str, level: int = logging.WARNING) -> None:
        self._hub.counter.count(reason, message, level)
