"""What a transfer backend is built from, as records: where it listens and how long it waits
(``NativeOptions``, ``SglangOptions``, ``VllmOptions``, each with ``NixlOptions`` for its
agent) and the calls it makes into the rest of the worker (``Hooks``). Torch-, ZMQ- and
NIXL-free; only ``service`` (start-up) sees the config these are filled from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer.slot_stage import StagedState
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import BootstrapLimits
from prefill_worker.transfer.vllm.groups import VllmGroups
from prefill_worker.transfer.vllm.profiles import DEFAULT_VERSIONS

if TYPE_CHECKING:
    from prefill_worker.curve import CurveServerKeys
    from prefill_worker.transfer.nixl.poster import WritePoster


@dataclass(frozen=True, slots=True)
class NixlOptions:
    """This worker's NIXL agent for one protocol."""

    agent_name: str | None = None  # None: a generated one
    backends: tuple[str, ...] = ("UCX",)
    ucx_net_devices: str | None = None  # UCX's interfaces; None: UCX picks
    capture_telemetry: bool = False  # NIXL measures each write (tracing's transfer span)


@dataclass(frozen=True, slots=True)
class NativeOptions:
    """The native bootstrap protocol: its socket, its peers' clocks, what they may ask."""

    bootstrap_bind: str  # a ZMQ endpoint; port 0 allowed (``bootstrap_endpoint`` says which)
    peer_timeout_s: float  # a peer silent, or a write in flight, this long fails its requests
    heartbeat_interval_s: float
    want_timeout_s: float = 30.0  # a `want` waits this long for its request
    nixl: NixlOptions = field(default_factory=NixlOptions)
    limits: BootstrapLimits = field(default_factory=BootstrapLimits)
    curve: CurveServerKeys | None = None  # CurveZMQ with an allow-list on the bootstrap socket
    push_thread: bool = True  # False: writes posted on the engine thread (benchmarks only)


@dataclass(frozen=True, slots=True)
class SglangOptions:
    """Where SGLang decodes reach this worker (``transfer.protocol`` sglang or both)."""

    http_bind: str  # host:port of /route and /health: the router's `--prefill URL PORT`
    rank_ip: str  # the control socket's address, as /route names it (an address decodes reach)
    rank_port: int  # 0: any free port
    kv_cache_dtype: str  # what /route announces; must equal the decodes' --kv-cache-dtype
    write_timeout_s: float  # a write in flight this long fails its request
    want_timeout_s: float  # a transfer request waits this long for its prefill
    health_stale_s: float = 30.0  # /health fails once the engine has not turned for this long
    allowed_networks: tuple[str, ...] = ()  # decodes' source networks (CIDR); empty: any
    rejoin_s: float = 0.0  # /health and /route answer 503 this long after the first turn
    nixl: NixlOptions = field(default_factory=NixlOptions)
    limits: BootstrapLimits = field(default_factory=BootstrapLimits)
    # A sliding-window model whose SGLang decodes may hold a hybrid SWA pool (gpt-oss):
    # those are sent the window (``sglang.swa``); None: every decode gets every layer's pages.
    sliding: SlidingLayers | None = None
    # A hybrid linear-attention model (Qwen3.5, Qwen3-Next): its full layers and the stage of
    # its state slots in SGLang's mamba layout (``sglang.mamba``); None: no state is sent.
    mamba: StagedState | None = None


@dataclass(frozen=True, slots=True)
class VllmIdentity:
    """What vLLM decodes hash with this worker's shape (their compatibility hash): the model
    string they were started with and their attention backend's name."""

    model: str = ""
    attention_backend: str = "FLASH_ATTN"  # CPU decodes: CPU_ATTN
    cache_dtype: str = "auto"  # their kv_cache_dtype (vllm.profiles.CACHE_DTYPES), hashed as is
    model_dtype: str | None = None  # their model dtype, hashed; None: the KV pool's (which is
    # the model's unless the pool is FP8)


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """Where vLLM decodes reach this worker and how long staged blocks wait for them."""

    side_channel_host: str  # the address decodes reach (kv_transfer_params' remote_host)
    side_channel_port: int  # 0: any free port
    block_size: int  # vLLM's block size (a multiple of 32 for its CPU attention backend)
    num_blocks: int  # staging blocks: the most KV held for decodes at once
    lease_s: float = 30.0  # vLLM's kv_lease_duration
    read_grace_s: float = 5.0  # an expired hold's blocks wait this long before reuse
    engine_id: str | None = None  # None: a generated one
    identity: VllmIdentity = field(default_factory=VllmIdentity)
    # The vLLM versions served (transfer.vllm.profiles), each on its own side channel from
    # side_channel_port on; the first is the one a request naming none gets.
    versions: tuple[str, ...] = DEFAULT_VERSIONS
    # vLLM's transfer modes served: "pull" (the decode READs), "push" (we WRITE into its
    # blocks on its registration), each version a side channel per mode.
    modes: tuple[str, ...] = ("pull",)
    nixl: NixlOptions = field(default_factory=NixlOptions)
    # A sliding-window model's KV-cache groups as vLLM 0.34 builds them (transfer.vllm.groups);
    # None: one group of every layer.
    groups: VllmGroups | None = None
    # A hybrid model's linear-layer state pool, staged in vLLM's page layout beside the KV
    # (transfer.vllm.state_staging); None: no linear layers.
    state: StateRegions | None = None
    # The decode's recurrent-state dtype (its mamba_ssm_cache_dtype, resolved), those pages'.
    state_ssm_dtype: str = "float32"
    # A windowed sliding pool's sliding layers (``pool_pages`` set): their window is staged
    # from the sliding pages (transfer.vllm.window_staging); None: a full pool.
    window: SlidingLayers | None = None


@dataclass(frozen=True, slots=True)
class Hooks:
    """What a backend calls: its clock; ``on_reject(reason)`` per refused message (engine
    thread); ``is_engine_live``, the daemon's liveness verdict (heartbeats and /health stop
    while it says stuck); ``wake``, the engine's inbox (SGLang's control thread); and where
    writes are posted (unset: the backend's transfer thread)."""

    clock: Callable[[], float] = time.monotonic
    on_reject: Callable[[str], None] | None = None
    is_engine_live: Callable[[], bool] = lambda: True
    wake: Callable[[], None] | None = None
    poster_factory: Callable[[Any], WritePoster] | None = None


DEFAULT_HOOKS = Hooks()
