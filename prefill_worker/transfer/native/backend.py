"""The native transfer backend: this worker's bootstrap server, its NIXL agent, and the
push hub that drives every sender.

One agent per worker (NIXL's progress thread off), owned by the transfer thread
(``nixl.push_thread``, or ``InlinePoster`` by ``poster_factory``): every NIXL call runs
there, never a copy on the engine thread. ``poll()`` (engine loop) hands each bootstrap
message to the desk, expires silent peers, turns the hub and sends heartbeats. Between turns
the engine sleeps in ``wait()`` on the bootstrap socket and the transfer thread's wake fd,
until ``next_poll_at()``. The pool and aux rows are registered and the local descriptor list
prepared once, each decode peer's once at registration, so a chunk is one prepared WRITE.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from msgspec import UNSET

from prefill_worker.kv.layout import KVRegions
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.native.bootstrap import BootstrapServer
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.native.dialect import NativeDialect
from prefill_worker.transfer.native.draft import LocalDraft
from prefill_worker.transfer.nixl.agent import (
    deregister_regions,
    make_agent,
    prep_lists,
    register_regions,
)
from prefill_worker.transfer.nixl.poster import InlinePoster, WritePoster
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from prefill_worker.transfer.nixl.state_lists import (
    LOCAL_AGENT,
    StateLists,
    prep_state_list,
    register_state,
)
from prefill_worker.transfer.options import DEFAULT_HOOKS, Hooks, NativeOptions
from prefill_worker.transfer.push.dialect import PageLists
from prefill_worker.transfer.push.hub import HubBackend
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.refusals import ExpiringTable, Refusals
from prefill_worker.transfer.push.sender import PushContext
from prefill_worker.transfer.swa_window import SlidingLayers

REFUSED_KEEP_S = 60.0  # how long a refused registration explains a room's missing handshake
_MAX_REFUSED_NAMES = 8


class NixlBackend(HubBackend[Peer]):
    """Serves the native bootstrap protocol and drives all its transfers."""

    def __init__(
        self,
        regions: KVRegions,
        options: NativeOptions,
        hooks: Hooks = DEFAULT_HOOKS,
        state: StateRegions | None = None,
        draft: DraftSide | None = None,
        sliding: SlidingLayers | None = None,
    ) -> None:
        """``state``: a hybrid model's state pool, each request's slot (its aux row) sent
        whole after its last pages and before its aux row. ``draft``: a draft model's pool
        and rows, for decodes that register a draft pool (``native.draft``). ``sliding``: a
        sliding-window model's layers; with a windowed sliding pool (``pool_pages``) each
        decode gets its sliding layers' window from it (``push.window_route``)."""
        self.regions, self.options = regions, options
        self.agent_name = options.nixl.agent_name or f"prefill-{uuid.uuid4().hex[:12]}"
        self.peer_timeout_s = options.peer_timeout_s
        self.clock = clock = hooks.clock
        # Heartbeats say the engine is alive: they stop while the daemon's liveness rule
        # finds it stuck (this backend also turns during forwards), so decodes give up.
        self._is_engine_live = hooks.is_engine_live
        self.limits = options.limits
        # First: a taken port fails fast.
        self._server = BootstrapServer(
            options.bootstrap_bind, self.limits.max_message_bytes, options.curve
        )
        self.bootstrap_endpoint = self._server.endpoint
        self.endpoints = {"bootstrap": self.bootstrap_endpoint}
        try:
            nixl = options.nixl
            self.agent = make_agent(
                self.agent_name,
                list(nixl.backends),
                nixl.ucx_net_devices,
                capture_telemetry=nixl.capture_telemetry,
            )
            self._reg = register_regions(self.agent, regions)
            self.local_lists = prep_lists(self.agent, LOCAL_AGENT, regions)
            self._state_reg = None if state is None else register_state(self.agent, state)
            self.state_lists = None
            if state is not None:
                self.state_lists = StateLists(
                    state, prep_state_list(self.agent, LOCAL_AGENT, state)
                )
            self._draft = None if draft is None else LocalDraft(self.agent, regions, draft)
        except BaseException:
            self._server.close()
            raise
        self._poster = _poster_factory(options, hooks)(self.agent)  # owns it until close()
        refusals = Refusals(
            ExpiringTable(REFUSED_KEEP_S, _MAX_REFUSED_NAMES), ExpiringTable(0.0, 1)
        )  # no room is refused here: a native decode never asks before it registers
        aux_list = self.local_lists.aux
        rows = None if draft is None else (regions.aux_base_addr, draft.rows)
        dialect = NativeDialect(self._server, self._poster, aux_list, refusals.names, clock, rows)
        layout = regions.layout
        head_bytes = layout.head_dim * layout.itemsize
        pages = PageLists(
            self.local_lists.kv, layout.num_regions, layout.region_page_bytes, head_bytes
        )
        ctx = PushContext(
            self._poster,
            pages,
            layout,
            dialect,
            options.peer_timeout_s,
            clock,
            state=self.state_lists,
            draft_pages=None if self._draft is None else self._draft.page_lists(pages),
        )
        self._start_hub(ctx, self.agent, refusals, "bootstrap", options, hooks)
        described = wire.Described(
            agent_name=self.agent_name,
            layout=wire.Layout.of(layout),
            compat_hash=layout.compat_hash(),
            heartbeat_interval_s=options.heartbeat_interval_s,
            peer_timeout_s=options.peer_timeout_s,
            state=UNSET if state is None else (wire.StatePool.of(state.component),),
        )
        self._desk = BootstrapDesk(
            self._hub,
            self._server,
            self.agent,
            layout,
            self.limits,
            described,
            self._poster.run,
            regions,
            None if state is None else state.component,
            draft,
            sliding,
        )
        self._next_heartbeat = clock()

    def lead_group(self, place: RankPlace) -> None:
        """Serve decodes for a TP group this backend is rank ``place.rank`` of (the leader):
        its desk describes every head and writes this rank's (``BootstrapDesk.lead``)."""
        self._desk.lead(place)

    # -- the TransferBackend seam (create_sender: HubBackend) ---------------------------

    def poll(self) -> None:
        self._poster.clear_wake()  # before reading write states: a later change wakes wait()
        for identity, msg in self._server.poll():
            self._desk.dispatch(identity, msg)
        self._hub.drain()  # statuses from the engine's fail()/close() since the last poll
        now = self.clock()
        self._expire(now)  # first: a silent peer, not its writes' deadline, is the cause
        self._hub.turn(now)
        if now >= self._next_heartbeat and self._is_engine_live():
            self._next_heartbeat = now + self.options.heartbeat_interval_s
            for identity in list(self._hub.peers):
                self._server.send(identity, wire.Heartbeat())

    def next_poll_at(self) -> float:
        """The earliest time (this backend's clock) ``poll`` has work that no message starts:
        the hub's, else the next heartbeat or peer timeout."""
        now = self.clock()
        times = [self._next_heartbeat]
        times += (p.last_seen + self.peer_timeout_s for p in self._hub.peers.values())
        hub_at = self._hub.next_poll_at(now)
        return min(times if hub_at is None else [*times, hub_at])

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Block until a bootstrap message arrives, ``wake_fd`` is readable, ``next_poll_at``
        comes, or ``timeout_s`` passes."""
        timeout_s = min(timeout_s, self.next_poll_at() - self.clock())
        if timeout_s > 0:
            poster_fd = self._poster.wake_fd
            self._server.wait(timeout_s, wake_fd, () if poster_fd is None else (poster_fd,))

    def close(self) -> None:
        self._hub.close()
        self._hub.ctx.pages.release_sliced()
        if self._hub.ctx.draft_pages is not None:
            self._hub.ctx.draft_pages.release_sliced()
        self.local_lists.release()
        if self.state_lists is not None:
            self.state_lists.prepped.release()
            self.agent.deregister_memory(self._state_reg)
        if self._draft is not None:
            self._draft.close()
        deregister_regions(self.agent, self._reg)
        self._server.close()

    def _expire(self, now: float) -> None:
        for peer in list(self._hub.peers.values()):
            if now - peer.last_seen > self.peer_timeout_s:
                why = f"decode peer silent for over {self.peer_timeout_s:g} s"
                self._hub.drop_peer(peer, why)


def _poster_factory(options: NativeOptions, hooks: Hooks) -> Callable[[Any], WritePoster]:
    if hooks.poster_factory is not None:
        return hooks.poster_factory
    telemetry = options.nixl.capture_telemetry
    if options.push_thread:
        return lambda agent: PushThread(agent, telemetry=telemetry)
    return lambda agent: InlinePoster(agent, telemetry)
