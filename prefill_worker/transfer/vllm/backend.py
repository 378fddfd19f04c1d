"""The transfer backend vLLM decodes pull from: this worker as a vLLM prefill.

It owns a NIXL agent with the staging region registered (``staging``: one region per layer,
vLLM's ``LBHNC`` blocks; a ``vllm_blocks`` pool registers itself instead, ``direct``) and
the side channel where decodes fetch that agent's metadata (``handshake``: a ZMQ ROUTER
answering ``get_meta_msg``). That agent never writes: a pull decode READs the blocks named
in the HTTP answer's ``kv_transfer_params`` and sends a notification when done; a push
decode's WRITE goes from the pusher's own agent on its transfer thread (``pusher``), whose
wake fd ``wait`` sleeps on. ``poll()`` (engine thread) drains the notifications into the
desk's holds and ends leases; NIXL has no fd to sleep on for them, so ``next_poll_at`` asks
for a turn every ``NOTIFY_POLL_S`` while blocks are held (every ``_IDLE_POLL_S``
otherwise), every ``PUSH_POLL_S`` while a push waits for its registration, and every
``REPACK_POLL_S`` while the repack thread (``desk``) works, so a request's answer leaves
soon after its last repack ends.

Restarts: each start registers with a new ``registration_generation`` (wall-clock
milliseconds, so it grows across restarts even with a fixed engine id) and a fresh hold-id
prefix; a decode that knew the previous run re-handshakes, and its notifications for the old
run's holds are counted as unknown.
"""

from __future__ import annotations

import logging
import math
import select
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from prefill_worker.kv.layout import KVRegions
from prefill_worker.kv.pins import PagePins
from prefill_worker.transfer.base import KVSender
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, make_agent
from prefill_worker.transfer.nixl.poster import WritePoster
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.options import (
    DEFAULT_HOOKS,
    Hooks,
    NixlOptions,
    VllmIdentity,
    VllmOptions,
)
from prefill_worker.transfer.vllm.desk import PullDesk, PullIdentity
from prefill_worker.transfer.vllm.direct import DirectSender, PoolBlocks, is_direct
from prefill_worker.transfer.vllm.groups import VllmGroups, layer_names, one_group
from prefill_worker.transfer.vllm.handshake import CompatFactors, compat_hash
from prefill_worker.transfer.vllm.holds import HoldTable
from prefill_worker.transfer.vllm.profiles import (
    FP8_POOL,
    PROFILES,
    PULL,
    PUSH,
    cache_dtype_refusal,
    channel_key,
)
from prefill_worker.transfer.vllm.push import (
    PUSH_REG_PREFIX,
    BadRegistration,
    Early,
    Expected,
    read_registration,
)
from prefill_worker.transfer.vllm.pusher import PushJob, VllmPusher
from prefill_worker.transfer.vllm.sender import VllmSender
from prefill_worker.transfer.vllm.shared import GroupStaging
from prefill_worker.transfer.vllm.staging import (
    PoolViews,
    StagingLayout,
    StagingPool,
    StagingRefused,
    staging_layout,
)
from prefill_worker.transfer.vllm.state_staging import StateStaging
from prefill_worker.transfer.vllm.tickets import Tickets
from prefill_worker.transfer.vllm.window_staging import StagedWindow, staged_window

log = logging.getLogger(__name__)

NOTIFY_POLL_S = 0.02  # while blocks are held: how soon a READ's notice frees them
REPACK_POLL_S = 0.002  # while a repack runs: how soon its end lets the answer go
PUSH_POLL_S = 0.001  # while a push waits for its registration or WRITE: how soon it moves
_IDLE_POLL_S = 0.2  # idle: how soon a first handshake is answered


@dataclass(frozen=True, slots=True)
class PullRegistration:
    """What the side channel tells a decode (vLLM's ``NixlAgentMetadata``, in our words), and
    what the compatibility hash is computed from (``identity``: the model string and the
    attention backend name the decodes use, from config)."""

    engine_id: str
    agent_metadata: bytes
    region_base_addrs: tuple[int, ...]  # one per layer, kv_cache_layout "LBHNC"
    block_bytes: int  # one block of one layer (K‖V); also the stride between blocks
    num_blocks: int
    block_size: int
    registration_generation: int
    layout: StagingLayout  # layers, KV heads, head_dim, itemsize
    dtype: str  # the pool's, a key of kv.layout.DTYPE_ITEMSIZE
    identity: VllmIdentity
    versions: tuple[str, ...]  # the vLLM versions served (``profiles``), each on its channel
    modes: tuple[str, ...] = (PULL,)  # and the transfer modes, a channel per version each
    groups: VllmGroups | None = None  # the layers' names and KV-cache groups (None: one)
    state_base_addrs: tuple[int, ...] = ()  # one per linear layer (``state_staging``)
    ssm_sizes: tuple[int, int] = (0, 0)  # a linear layer's (conv, recurrent) bytes

    @property
    def layer_groups(self) -> VllmGroups:
        """The layers' vLLM names and KV-cache groups (one group unless ``groups`` says)."""
        return self.groups or one_group(layer_names(None, self.layout.num_layers))


def our_hash(registration: PullRegistration, version: str, mode: str = PULL) -> str:
    """vLLM's compatibility hash of our shape, as a decode of ``version`` in ``mode`` computes
    its own (equal to it iff that decode may pair with us)."""
    lay, identity = registration.layout, registration.identity
    factors = CompatFactors(
        model=identity.model,
        dtype=identity.model_dtype or registration.dtype,
        num_kv_heads=lay.num_kv_heads,
        head_size=lay.head_dim,
        num_layers=len(registration.layer_groups.names),  # every model layer
        attn_backend_name=identity.attention_backend,
        cache_dtype=identity.cache_dtype,
        transfer_mode=mode,
    ).for_profile(PROFILES[version])
    return compat_hash(factors)


def _staged_window(
    regions: KVRegions, options: VllmOptions, group: GroupStaging | None
) -> StagedWindow | None:
    """A windowed sliding pool's staging (``window_staging``), or None for a full pool."""
    if options.window is None:
        return None
    if options.groups is None or group is not None or is_direct(regions):
        raise StagingRefused(
            "cache.sliding_pool windowed: vLLM decodes are staged from it at worker TP 1, in "
            "their KV-cache groups, from a layer_major pool"
        )
    ps = regions.layout.page_size
    return staged_window(options.window, options.groups, ps, options.block_size)


def check_cache_dtype(identity: VllmIdentity, pool_dtype: str) -> None:
    """``ValueError`` with the reason when the decodes ``identity`` describes cannot read a
    pool of ``pool_dtype`` as theirs (their hash would differ from ours, or worse, agree)."""
    if identity.model_dtype is None and pool_dtype == FP8_POOL:
        raise ValueError(
            "an FP8 KV pool served to vLLM decodes needs their model dtype (the hash covers "
            "it apart from the cache dtype): set model.dtype"
        )
    model_dtype = identity.model_dtype or pool_dtype
    reason = cache_dtype_refusal(identity.cache_dtype, pool_dtype, model_dtype)
    if reason is not None:
        raise ValueError(reason)


class SideChannels(Protocol):
    """The decode-facing handshake servers (``channel``), one per vLLM version of one
    registration; ``poll`` answers what is pending and never blocks."""

    @property
    def ports(self) -> Mapping[str, int]: ...  # version -> the port it is served on

    def poll(self) -> int: ...

    def close(self) -> None: ...


SideChannelFactory = Callable[[str, int, PullRegistration], SideChannels]


class VllmBackend:
    """Serves vLLM decodes' pulls from the staging region; the engine drives ``poll``."""

    def __init__(
        self,
        regions: KVRegions,
        options: VllmOptions,
        tickets: Tickets,
        side_channel: SideChannelFactory,
        hooks: Hooks = DEFAULT_HOOKS,
        group: GroupStaging | None = None,
        pins: PagePins | None = None,
    ) -> None:
        """``group``: a tensor-parallel worker's shared region (``shared``), which this
        backend registers and answers for as one prefill rank holding every KV head.
        ``pins``: the engine's page pins, with which a ``vllm_blocks`` pool is served
        straight from its pages (``direct``; at TP > 1 ``group`` is the group's pool)."""
        check_cache_dtype(options.identity, regions.layout.dtype)
        self.clock = hooks.clock
        heads = None if group is None else group.num_kv_heads
        staging: StagingPool | PoolBlocks
        self.direct: PoolBlocks | None = None  # the pool is the blocks: no staging region
        if is_direct(regions):
            if pins is None:
                raise StagingRefused("a vllm_blocks pool served without the engine's page pins")
            if options.state is not None:
                raise StagingRefused("kv layout vllm_blocks: a linear-attention model's state")
            staging = self.direct = PoolBlocks(regions, options.block_size, pins, group)
            log.info("vllm: decodes served from the vllm_blocks pool itself (no staging region)")
        else:
            layout = staging_layout(regions, options.block_size, options.num_blocks, heads)
            staging = StagingPool(layout, None if group is None else group.buffer)
        self.state_staging: StateStaging | None = None  # a linear hybrid's state pages
        if options.state is not None:  # at TP > 1 the leader's whole slots (state_gather)
            blocks, page_bytes = staging.layout.num_blocks, staging.layout.block_bytes
            ssm_dtype = options.state_ssm_dtype
            self.state_staging = StateStaging(options.state, blocks, page_bytes, ssm_dtype)
        self.mirror_heads = None if group is None else group.heads
        holds = HoldTable(options.lease_s, options.read_grace_s)
        window = _staged_window(regions, options, group)
        self._repacker = ThreadPoolExecutor(1, thread_name_prefix="vllm-repack")
        pool = PoolViews(regions, () if window is None else window.sliding)
        self.desk = PullDesk(staging, pool, holds, tickets, self.clock, self._repacker, group)
        self.desk.groups, self.desk.window = options.groups, window
        engine_id = options.engine_id or f"prefill-vllm-{uuid.uuid4().hex[:12]}"
        nixl = options.nixl
        self._push_registered: tuple[Any, Any] | None = None  # (the push agent, its regions)
        self.agent: Any = make_agent(
            nixl.agent_name or engine_id,
            list(nixl.backends),
            nixl.ucx_net_devices,
            # a pull decode's READ over UCX's TCP is served only while this side progresses;
            # serving push alone, the engine thread is the agent's only user and progresses it
            # as it drains notifications (an idle progress thread costs ~0.37 of a core)
            progress_thread=PULL in options.modes,
        )
        lay = staging.layout
        table = np.array(
            [[a, lay.region_bytes, 0] for a in staging.region_base_addrs], dtype=np.uint64
        )
        self._registered = self.agent.register_memory(table, "DRAM")
        self.desk.state_staging = state = self.state_staging
        self._registered_state = None if state is None else state.register(self.agent)
        registration = PullRegistration(
            engine_id,
            self.agent.get_agent_metadata(),
            staging.region_base_addrs,
            lay.block_bytes,
            lay.num_blocks,
            lay.block_size,
            time.time_ns() // 1_000_000,
            lay,
            regions.layout.dtype,
            options.identity,
            options.versions,
            options.modes,
            options.groups,
            () if state is None else state.region_base_addrs,
            (0, 0) if state is None else state.page.ssm_sizes,
        )
        try:
            host, port = options.side_channel_host, options.side_channel_port
            self._channel = side_channel(host, port, registration)
        except BaseException:
            self._deregister()
            raise
        generation = registration.registration_generation
        self.desk.identities = {
            key: PullIdentity(engine_id, host, at, generation)
            for key, at in self._channel.ports.items()
        }
        self.registration = registration
        ports = self._channel.ports
        first = channel_key(options.versions[0], options.modes[0])
        self.bootstrap_endpoint = f"tcp://{host}:{ports[first]}"
        self.pusher: VllmPusher | None = None
        if PUSH in options.modes:
            try:
                name = f"{nixl.agent_name or engine_id}-push"
                free = staging.free
                self.pusher = self._open_pusher(name, nixl, registration, table, free, hooks)
            except BaseException:
                self._channel.close()
                self._deregister()
                raise
        self.endpoints: Mapping[str, str] = {
            f"vllm_side_channel_{version}": f"tcp://{host}:{at}" for version, at in ports.items()
        }

    def _open_pusher(
        self,
        name: str,
        nixl: NixlOptions,
        registration: PullRegistration,
        table: np.ndarray,
        free: Callable[[Sequence[int]], None],
        hooks: Hooks,
    ) -> VllmPusher:
        """The push side: an agent of its own with the same regions registered, NIXL's
        progress thread off, owned by a transfer thread (``pusher`` says why)."""
        agent = make_agent(name, list(nixl.backends), nixl.ucx_net_devices)
        self._push_registered = (agent, agent.register_memory(table, "DRAM"))
        if hooks.poster_factory is None:
            poster: WritePoster = PushThread(agent, "nixl-push-vllm", hooks.wake)
        else:
            poster = hooks.poster_factory(agent)
        hashes = {v: our_hash(registration, v, PUSH) for v in registration.versions}
        bases, lay = registration.region_base_addrs, registration.layout
        return VllmPusher(agent, poster, bases, lay, hashes, free, self.clock)

    @property
    def mirror_layers(self) -> tuple[np.ndarray, ...]:
        """The staging region per layer, ``[num_blocks, heads, block_size, 2 * head_dim]`` (the
        pool's itemsize): what the runner's KV mirror is built over, so that the forward writes
        the blocks of the chunks the senders mirror (``sender.mirror_slots``); at TP > 1 this
        rank's heads of them (``mirror_heads``)."""
        staging = self.desk.staging
        if not isinstance(staging, StagingPool) or self.desk.window is not None:
            return ()  # the pool itself, or a windowed sliding pool's (repacked): no mirror
        return tuple(staging.layer_view(i) for i in range(staging.layout.num_layers))

    # -- the TransferBackend seam -------------------------------------------------------

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        if self.direct is not None:
            return DirectSender(self.desk, self.direct, room, num_prompt_tokens)
        return VllmSender(self.desk, room, num_prompt_tokens)

    def poll(self) -> None:
        self.desk.sync()  # at TP > 1: the followers' repacks go on a step now
        self._channel.poll()  # handshakes: a decode waits 5 s for its answer
        try:
            notifs = self.agent.get_new_notifs()
        except NIXL_ERRORS:  # a decode's connection broke: its holds end at their leases
            notifs = {}
        for agent, messages in notifs.items():
            for message in messages:
                if message.startswith(PUSH_REG_PREFIX):
                    self._on_registration(agent, message)
                else:
                    self.desk.notify(agent, message)
        while self.desk.matched:
            self._push(*self.desk.matched.pop())
        self.desk.expire()
        if self.pusher is not None:
            self.pusher.poll()

    def _on_registration(self, agent: str, message: bytes) -> None:
        """A push decode's registration: its request's WRITE, now or once it is held."""
        book = self.desk.pushes
        if self.pusher is None:
            book.refused["push_not_served"] += 1
            return
        try:
            reg = read_registration(message)
        except BadRegistration as exc:
            book.refused["malformed"] += 1
            self.desk.bad_log.warning(self.clock(), "vllm: registration ignored: %s", exc)
            return
        wanted = book.registered(agent, reg, self.clock())
        if wanted is not None:
            self._push(wanted, Early(agent, reg, 0.0))

    def _push(self, wanted: Expected, early: Early) -> None:
        assert self.pusher is not None
        blocks = self.desk.holds.take(wanted.hold_id)
        if blocks is None:  # its lease passed first
            self.desk.pushes.refused["expired"] += 1
            return
        self.pusher.push(PushJob(wanted.hold_id, blocks, early.registration, wanted.version))

    def take_claimed_rooms(self) -> Sequence[int]:
        """A pull's ticket is open before its request exists: its sender is READY at once."""
        return ()

    def next_poll_at(self) -> float:
        now = self.clock()
        if self.desk.has_repacks():
            return now + REPACK_POLL_S
        pusher = self.pusher
        if self.desk.pushes.expected or (pusher is not None and pusher.needs_polling):
            return now + PUSH_POLL_S
        if len(self.desk.holds) or (pusher is not None and pusher.busy):  # WRITEs: wake fd
            return now + NOTIFY_POLL_S
        deadline = self.desk.holds.next_deadline()
        return min(now + _IDLE_POLL_S, math.inf if deadline is None else deadline)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        timeout_s = min(timeout_s, self.next_poll_at() - self.clock())
        push_fd = None if self.pusher is None else self.pusher.wake_fd
        fds = [fd for fd in (wake_fd, push_fd) if fd is not None]
        if timeout_s > 0 and fds:
            select.select(fds, [], [], timeout_s)
        elif timeout_s > 0:
            time.sleep(timeout_s)

    def close(self) -> None:
        """Repacks end (queued ones cancelled), holds end (nothing reads a closed agent), the
        side channel and agent close."""
        self._repacker.shutdown(wait=True, cancel_futures=True)
        if self.pusher is not None:
            self.pusher.close()
        self.desk.close()
        try:
            self._channel.close()
        finally:
            self._deregister()

    def _deregister(self) -> None:
        if self._push_registered is not None:  # the pusher closed first: the agent is ours
            agent, registered = self._push_registered
            agent.deregister_memory(registered)
        self.agent.deregister_memory(self._registered)
        if self._registered_state is not None:
            self.agent.deregister_memory(self._registered_state)
