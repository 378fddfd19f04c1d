"""The transfer backend SGLang decode servers talk to: this worker as an SGLang prefill.

Threads: the bootstrap HTTP routes (``bootstrap_http``: ``/route``, ``/health``) and the PULL
control socket (``control``) run on their own threads and hand what arrives to the engine
through a ``Mailbox``; the NIXL agent is owned by this backend's transfer thread. ``poll()``
(engine thread) gives each message to the ``SglangDesk``, turns the hub and evicts idle
peers past ``MAX_PEERS``; between turns the engine sleeps in ``wait()`` on the mailbox's pipe
and the transfer thread's wake fd (both also call ``wake``, for an engine sleeping elsewhere).
Our pool is described per layer whatever its layout, as SGLang's pools are.

Restarts (the rejoin window, ``rejoin_s``) and decode liveness (``/health``, which fails once
this engine has not turned for ``health_stale_s`` or is stuck in a forward) are described in
docs/sglang.md.
"""

from __future__ import annotations

import ipaddress
import math
import select
import uuid
from collections.abc import Callable, Mapping

from prefill_worker.kv.layout import KVRegions
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer.base import KVSender
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.nixl.poster import WritePoster
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from prefill_worker.transfer.nixl.state_lists import (
    LOCAL_AGENT,
    StateLists,
    prep_state_list,
    register_state,
)
from prefill_worker.transfer.options import DEFAULT_HOOKS, Hooks, SglangOptions
from prefill_worker.transfer.push.dialect import PageLists
from prefill_worker.transfer.push.hub import HubBackend
from prefill_worker.transfer.push.refusals import ExpiringTable, Refusals
from prefill_worker.transfer.push.sender import PushContext
from prefill_worker.transfer.sglang import aux
from prefill_worker.transfer.sglang.accept import server_info
from prefill_worker.transfer.sglang.bootstrap_http import BootstrapHttp
from prefill_worker.transfer.sglang.components import StateComponents
from prefill_worker.transfer.sglang.control import ControlSocket, Mailbox, ReplySockets
from prefill_worker.transfer.sglang.desk import SglangDesk
from prefill_worker.transfer.sglang.dialect import SglangDialect, SglangPeer
from prefill_worker.transfer.sglang.dsa import open_local
from prefill_worker.transfer.sglang.local import LocalSide, close_all
from prefill_worker.transfer.sglang.mamba_stage import StagingSender
from prefill_worker.transfer.slot_stage import StagedState

MAX_PEERS = 256  # registered decode ranks kept; idle ones past it are evicted
MAX_REGISTRATIONS_PER_TURN = 4  # each loads NIXL metadata; the rest wait for the next turn
_IDLE_POLL_S = 1.0
_MAX_REFUSED_ROOMS = 1024  # a frame costs an unregistered sender nothing: capped


class SglangBackend(HubBackend[SglangPeer]):
    """Serves SGLang's bootstrap routes and control socket; the hub drives the transfers."""

    def __init__(
        self,
        regions: KVRegions,
        options: SglangOptions,
        hooks: Hooks = DEFAULT_HOOKS,
        draft: DraftSide | None = None,  # a draft model's pool and rows (``transfer.draft``)
        dsa: StateRegions | None = None,  # a DSA model's FP8 index pages (``sglang.dsa``)
    ) -> None:
        self.clock = clock = hooks.clock
        self.limits = options.limits
        self._last_poll_at = clock()
        self._health_stale_s = options.health_stale_s
        self._opens_at = clock() + options.rejoin_s  # built just before the engine serves
        self._is_engine_live = hooks.is_engine_live  # the daemon's liveness verdict (HTTP thread)
        self._mailbox = Mailbox(hooks.wake)
        self._closers: list[Callable[[], None]] = [self._mailbox.close]
        nixl = options.nixl
        agent_name = nixl.agent_name or f"prefill-sglang-{uuid.uuid4().hex[:12]}"
        try:
            self._start_io(regions, options)
            local = LocalSide(regions, agent_name, nixl, draft)
        except BaseException:
            self._close_all()
            raise
        self._closers.append(local.close)
        self.agent = local.agent
        self._mamba = options.mamba
        state = None  # a DSA model's index pages, or a hybrid model's staged state slots
        try:
            if dsa is not None:
                state, release = open_local(self.agent, dsa)
                self._closers.append(release)
            elif self._mamba is not None:
                state = self._open_stage(self._mamba)
        except BaseException:
            self._close_all()
            raise
        if hooks.poster_factory is None:
            self._poster: WritePoster = PushThread(
                self.agent, "nixl-push-sglang", hooks.wake, nixl.capture_telemetry
            )
        else:
            self._poster = hooks.poster_factory(self.agent)
        # From here the transfer thread owns the agent; close() stops it before the closers.
        rows = aux.AuxRowsView(regions.aux_base_addr, regions.num_aux_rows)
        draft_rows = None if draft is None else draft.rows
        dialect = SglangDialect(
            self._replies, self._poster, local.staging, rows, local.spec_staging, draft_rows
        )
        layout = regions.layout
        head_bytes = layout.head_dim * layout.itemsize
        pages = PageLists(
            local.kv_list, layout.planes * layout.num_layers, layout.page_bytes, head_bytes
        )
        num_draft_layers = 0 if draft is None else draft.num_layers
        draft_pages = None
        if draft is not None:
            num_regions = layout.planes * (layout.num_layers + num_draft_layers)
            draft_pages = PageLists(local.draft_list, num_regions, layout.page_bytes, head_bytes)
        ctx = PushContext(
            self._poster,
            pages,
            layout,
            dialect,
            options.write_timeout_s,
            clock,
            state=state,
            draft_pages=draft_pages,
        )
        # Names are never refused for a room here: an SGLang decode asks, and hears why.
        refusals = Refusals(
            ExpiringTable(0.0, 1), ExpiringTable(options.want_timeout_s, _MAX_REFUSED_ROOMS)
        )
        self._start_hub(ctx, self.agent, refusals, "sglang", options, hooks)
        self._desk = SglangDesk(
            self._hub,
            self.agent,
            self._replies,
            layout,
            self.limits,
            lambda: not self._is_open(),
            self._poster.run,
            [ipaddress.ip_network(n) for n in options.allowed_networks],
            regions,
            None if draft is None else draft.regions,
            StateComponents(
                self.agent, self.limits, self._poster.run, options.sliding, dsa, options.mamba
            ),
        )
        self._closers.append(pages.release_sliced)  # before the local side (closed last first)
        if draft_pages is not None:
            self._closers.append(draft_pages.release_sliced)
        self._closers.append(self._desk.release_shares)
        self._control.start()

    def _start_io(self, regions: KVRegions, options: SglangOptions) -> None:
        """Sockets first: a taken port fails start-up before NIXL is touched."""
        self._control = ControlSocket(
            options.rank_ip, options.rank_port, self.limits.max_message_bytes, self._mailbox.put
        )
        self._closers.append(self._control.close)
        rank = {"rank_ip": options.rank_ip, "rank_port": self._control.endpoint.port}
        self._page_size, self._kv_cache_dtype = regions.layout.page_size, options.kv_cache_dtype
        info = server_info(self._page_size, self._kv_cache_dtype)
        http = BootstrapHttp(options.http_bind, info, rank, self._is_healthy, self._is_open)
        self._http = http
        self._http.start()
        self._closers.append(self._http.stop)
        self._replies = ReplySockets()
        self._closers.append(self._replies.close)
        self.bootstrap_endpoint = self._http.address
        self.endpoints: Mapping[str, str] = {
            "sglang_bootstrap": self._http.address,
            "sglang_control": self._control.endpoint.address,
        }

    def _open_stage(self, mamba: StagedState) -> StateLists:
        """The staging of our state slots in SGLang's layout, registered and listed (before
        the transfer thread owns the agent)."""
        regions = mamba.stage.regions()
        reg = register_state(self.agent, regions)
        self._closers.append(lambda: self.agent.deregister_memory(reg))
        prepped = prep_state_list(self.agent, LOCAL_AGENT, regions)
        self._closers.append(prepped.release)
        return StateLists(regions, prepped)

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        """The hub's sender; a hybrid model's stages the request's state slot (``sglang.mamba``)
        when its aux row is handed over."""
        sender = self._hub.create_sender(
            room, request_id, num_prompt_tokens, allowed_peer, traceparent
        )
        if self._mamba is None:
            return sender
        return StagingSender(sender, self._mamba.stage)

    def lead_group(self, place: RankPlace) -> None:
        """Serve SGLang decodes for a TP group this backend is the leader (rank 0) of: its
        routes and control socket answer for every rank (``SglangDesk.lead``)."""
        assert place.rank == 0, "only the leader serves SGLang decodes"
        info = server_info(self._page_size, self._kv_cache_dtype, place.tp_size)
        self._http.lead(info, place.tp_size)
        self._desk.lead(place.tp_size, place.num_kv_heads)

    def lead_dp(
        self,
        rank_infos: list[dict[str, object]],
        query_rooms: Callable[[list[int]], dict[str, int]],
    ) -> None:
        """Serve SGLang decodes for an attention-DP worker whose rank 0 this backend is: its
        routes name every rank's control socket (``BootstrapHttp.lead_dp``)."""
        info = server_info(self._page_size, self._kv_cache_dtype, dp_size=len(rank_infos))
        self._http.lead_dp(info, rank_infos, query_rooms)

    # -- the TransferBackend seam (create_sender: HubBackend) ---------------------------

    def poll(self) -> None:
        self._poster.clear_wake()  # before reading write states: a later change wakes wait()
        now = self._last_poll_at = self.clock()
        for received in self._mailbox.take(MAX_REGISTRATIONS_PER_TURN):
            self._desk.dispatch(received.message, received.source_ip)
        self._hub.drain()
        self._hub.turn(now)
        self._evict_idle_peers()

    def next_poll_at(self) -> float:
        now = self.clock()
        if self._mailbox.has_items:
            return now
        hub_at = self._hub.next_poll_at(now)
        return min(now + _IDLE_POLL_S, math.inf if hub_at is None else hub_at)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        timeout_s = min(timeout_s, self.next_poll_at() - self.clock())
        if timeout_s > 0:
            fds = (self._mailbox.fileno(), wake_fd, self._poster.wake_fd)
            select.select([fd for fd in fds if fd is not None], [], [], timeout_s)

    def close(self) -> None:
        self._hub.close()
        self._close_all()

    # -- internals ----------------------------------------------------------------------

    def _is_healthy(self) -> bool:  # the HTTP thread
        """Polled lately, and the engine live: this backend also turns while a forward runs,
        so a stuck forward shows only in the engine's liveness."""
        is_fresh = self.clock() - self._last_poll_at <= self._health_stale_s
        return is_fresh and self._is_engine_live()

    def _is_open(self) -> bool:  # the HTTP thread
        return self.clock() >= self._opens_at

    def _evict_idle_peers(self) -> None:
        peers = self._hub.peers
        if len(peers) <= MAX_PEERS:
            return
        idle = [p for p in peers.values() if not p.rooms and not p.unmatched]
        idle.sort(key=lambda p: p.last_seen)
        for peer in idle[: max(0, len(peers) - MAX_PEERS)]:
            why = f"more than {MAX_PEERS} decode ranks registered; idle longest"
            self._hub.drop_peer(peer, why)

    def _close_all(self) -> None:
        close_all(self._closers, "the backend")
