"""Start-up steps: build each component from the config, and name the step that failed.

Each ``start_*``/``load_*``/``make_*`` function is one step of the daemon's start-up: it runs
inside ``startup_step``, so any failure becomes a ``StartupError`` that names the step and
carries the exit code (78 for configuration problems, 1 otherwise). The daemon calls them in
order and owns what they return; nothing here keeps state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from prefill_worker import __version__
from prefill_worker.batch import ModelRunner
from prefill_worker.inbox import Inbox
from prefill_worker.ingress.http import HttpApi, ServedModel, load_text_codec
from prefill_worker.ingress.validate import Limits
from prefill_worker.ingress.zmq_front import CurveServerKeys, Ingress
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.cache_events import CacheEventSink
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import MLA, KVLayout, KVRegions
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.prefix_cache import NoPrefixCache, PrefixCache
from prefill_worker.kv.sliding import SlidingPageTable
from prefill_worker.kv.state_layout import LINEAR_STATE, StateRegions
from prefill_worker.kv_events import KVEventPublisher, KVEventsError
from prefill_worker.kv_events.wire import DENSE, FULL_ATTENTION, MLA_ATTENTION, EventGroup
from prefill_worker.load import LoadSource
from prefill_worker.model import CheckpointError, KVCache, LoadProgress, ModelInfo, Runner
from prefill_worker.model.draft.runner import DraftingRunner
from prefill_worker.model.kv_cache import KV_TORCH_DTYPES
from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.model.parallel import SINGLE, TPGroup
from prefill_worker.model.qwen3_next import Qwen3NextLM
from prefill_worker.request import Outcome
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from prefill_worker.scheduler.warmup import warm_up
from prefill_worker.service.config import EX_CONFIG, Config
from prefill_worker.service.http import AdminAccess, Health, HttpServer
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.sliding_pool import WINDOWED, windowed_pages, windowed_refusal
from prefill_worker.service.telemetry import EngineEvents, IngressEvents, KVEventsTelemetry
from prefill_worker.service.tracing import RequestTracer
from prefill_worker.service.vllm_metrics import VllmPullCollector
from prefill_worker.tp.leader import local_runner
from prefill_worker.transfer.base import TransferBackend
from prefill_worker.transfer.decode.pool import pool_device
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.factory import (
    Transfer,
    make_backend,
    make_sglang_backend,
    make_vllm_backend,
    serve_protocols,
)
from prefill_worker.transfer.options import (
    Hooks,
    NativeOptions,
    NixlOptions,
    SglangOptions,
    VllmIdentity,
    VllmOptions,
)
from prefill_worker.transfer.sglang.mamba_stage import MambaStage
from prefill_worker.transfer.sglang.swa import HYBRID_SWA_ARCHITECTURES
from prefill_worker.transfer.slot_stage import StagedState
from prefill_worker.transfer.state_guard import STATE_CARRIERS, guard_backends
from prefill_worker.transfer.swa_window import SlidingLayers, decode_window_tokens, guard_unproven
from prefill_worker.transfer.validate import BootstrapLimits
from prefill_worker.transfer.vllm.groups import VllmGroups, linear_groups, sliding_groups
from prefill_worker.transfer.vllm.shared import GroupStaging
from prefill_worker.transfer.vllm.state_staging import decode_ssm_dtype
from prefill_worker.transfer.vllm.tickets import Tickets

# The daemon's logger: start-up lines keep the name they had before the steps moved here.
log = logging.getLogger("prefill_worker.service.daemon")

ModelBuilder = Callable[..., tuple[Runner, KVCache, ModelInfo]]
"""The shape of ``prefill_worker.model.build`` (the checkpoint path, then its keywords): the
daemon's one seam to the model, so tests can hold the load back or fail a forward."""


class StartupError(Exception):
    def __init__(self, step: str, message: str, exit_code: int) -> None:
        super().__init__(f"start-up failed at step '{step}': {message}")
        self.step, self.exit_code = step, exit_code


@contextmanager
def startup_step(name: str, config_errors: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Turn any failure inside into a ``StartupError`` naming the step."""
    log.info("start-up: %s", name)
    try:
        yield
    except config_errors as exc:
        raise StartupError(name, str(exc), EX_CONFIG) from exc
    except Exception as exc:
        raise StartupError(name, f"{type(exc).__name__}: {exc}", 1) from exc


def start_http(
    config: Config, health: Health, registry: CollectorRegistry, on_drain: Callable[[], None]
) -> HttpServer:
    cfg = config.metrics
    with startup_step("http", (ValueError,)):
        admin = AdminAccess.from_token_file(cfg.admin_token_file, cfg.allow_unauthenticated_admin)
        http = HttpServer(cfg.bind, health, registry, on_drain, admin)
        http.start()
    return http


class LoadReport:
    """Model-load progress as an operator sees it: a log line at every ``step_percent`` of the
    bytes and the same words as systemd's STATUS (``systemctl status`` shows it)."""

    def __init__(
        self,
        status: Callable[[str], None],
        step_percent: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._status, self._step, self._clock = status, step_percent, clock
        self._started = clock()
        self._next_percent = 0

    def __call__(self, num_read: int, total: int) -> None:
        percent = 100 * num_read // total if total else 100
        if percent < self._next_percent:
            return
        self._next_percent = (percent // self._step + 1) * self._step
        elapsed_s = max(self._clock() - self._started, 1e-9)
        text = (
            f"loading model: {num_read / 2**30:.2f} of {total / 2**30:.2f} GiB ({percent}%, "
            f"{num_read / 2**20 / elapsed_s:.0f} MiB/s)"
        )
        log.info("%s", text)
        self._status(text)


def load_model(
    config: Config,
    build_model: ModelBuilder,
    on_progress: LoadProgress | None = None,
    *,
    tp: TPGroup = SINGLE,
    device: str | None = None,
    dp: TPGroup = SINGLE,
) -> tuple[Runner, KVCache, ModelInfo]:
    """This rank's shard (``tp``; TP 1: the whole model) on ``device`` (None: the
    configured one); ``dp``: an attention-DP rank's place, when the experts are placed over
    the DP ranks (``parallel.ep_size`` = ``dp_size``)."""
    cfg = config
    with startup_step("model load", (CheckpointError, ValueError)):
        refused = windowed_refusal(cfg)
        if refused is not None:
            raise ValueError(refused)
        started = time.monotonic()
        more: dict[str, object] = {"dp": dp} if dp.size > 1 else {}
        if cfg.cache.sliding_pool == WINDOWED:  # its sliding layers' own page space
            more["sliding_pages"] = windowed_pages(cfg)
        runner, kv_cache, info = build_model(
            cfg.model.path,
            on_progress=on_progress,
            dtype=cfg.model.dtype,
            device=device or cfg.model.device,
            tp=tp,
            attention_backend=cfg.model.attention_backend,
            moe_backend=cfg.model.moe_backend,
            page_size=cfg.cache.page_size,
            pool_layout=cfg.cache.layout,
            num_pages=cfg.cache.num_pages,
            memory_bytes=cfg.cache.memory_bytes,
            memory_fraction=cfg.cache.memory_fraction,
            num_threads=cfg.model.num_threads,
            num_state_slots=cfg.cache.num_aux_rows,  # a hybrid's state slot is the aux row
            **_draft_args(cfg),
            kv_dtype=cfg.cache.kv_dtype,
            ep_size=cfg.parallel.ep_size,
            expert_placement=tuple(cfg.parallel.expert_placement),
            ep_exchange=cfg.parallel.ep_exchange,
            **more,
        )
        log.info(
            "model %s (%s, %s, attention %s, experts %s) loaded in %.1f s",
            info.architecture,
            info.dtype,
            info.device,
            info.attention_backend,
            info.moe_backend or "none (dense)",
            time.monotonic() - started,
        )
    return runner, kv_cache, info


def make_pools(config: Config, kv_cache: KVCache) -> tuple[PagePool, AuxPool]:
    with startup_step("kv pools"):
        return PagePool(kv_cache.layout.num_pages), AuxPool(config.cache.num_aux_rows)


def make_sliding(config: Config, kv_cache: KVCache, info: ModelInfo) -> SlidingPageTable | None:
    """A windowed sliding pool's bookkeeping (``kv.sliding``); None without one."""
    space = kv_cache.sliding
    if space is None:
        return None
    assert info.sliding_window is not None, "a sliding pool of a model without a window"
    with startup_step("sliding pool"):
        pool = PagePool(space.num_pages)
        cfg = config
        return SlidingPageTable(
            pool, cfg.cache.page_size, info.sliding_window, cfg.scheduler.chunk_size
        )


def warm_up_model(
    config: Config,
    runner: ModelRunner,
    pages: PagePool,
    vocab_size: int,
    metrics: WorkerMetrics,
    status: Callable[[str], None],
    sliding: SlidingPageTable | None = None,
) -> None:
    """The warm-up forward (``scheduler.warmup_tokens``; 0: none) before readiness;
    ``status`` (sd_notify's STATUS) says it is under way; ``sliding``: a windowed sliding
    pool's bookkeeping, whose pages the warm-up chunks take and give back."""
    cfg = config.scheduler
    if cfg.warmup_tokens == 0:
        return
    status("warming up")
    with startup_step("warm-up"):
        done = warm_up(
            runner,
            pages,
            config.cache.page_size,
            cfg.warmup_tokens,
            vocab_size,
            cfg.chunk_size,
            sliding,
        )
    metrics.warmup_seconds.set(done.duration_s)
    log.info("warm-up: %d tokens in %.2f s", done.num_tokens, done.duration_s)


def make_prefix_cache(
    config: Config, pages: PagePool, events: CacheEventSink, can_share: bool = True
) -> PrefixCache:
    """The prefix cache over the pool (``cache.prefix_caching``), reporting to ``events``.
    ``can_share`` False (a hybrid model: a hit would skip its linear layers' state, which
    pages do not hold; a DSA model's index keys are in its pages, so it shares): none,
    whatever the configuration says."""
    cfg = config.cache
    with startup_step("prefix cache"):
        if cfg.prefix_caching and not can_share:
            log.info("prefix cache: off (a hybrid model's state is not in its pages)")
        if not cfg.prefix_caching or not can_share:
            return NoPrefixCache(pages)
        return PagePrefixCache(pages, cfg.page_size, cfg.prefix_cache_max_pages, events)


def start_transfer(
    config: Config,
    regions: KVRegions,
    metrics: WorkerMetrics,
    wake: Callable[[], None],
    is_live: Callable[[], bool],
    state: StateRegions | None = None,
    sliding: SlidingModel | None = None,
    vllm_staging: GroupStaging | None = None,
    draft: DraftSide | None = None,
    sglang_dsa: StateRegions | None = None,
    mamba: StagedState | None = None,
    pins: PagePins | None = None,
) -> Transfer:
    """The backends of ``transfer.protocol``; ``wake`` wakes the engine (the SGLang control
    thread calls it when a message arrives); ``is_live`` is the daemon's liveness verdict
    (SGLang's ``/health`` fails with it). ``state``: a hybrid model's state pool, which the
    native protocol sends beside the KV; every other protocol's backend then refuses each
    claimed room with a typed reason (``transfer.state_guard``). ``sliding``: a
    sliding-window model's layers, whose rooms every protocol but native and SGLang refuses
    likewise (``transfer.swa_window``); SGLang sends its window to a decode with a hybrid SWA
    pool (``transfer.sglang.swa``). ``vllm_staging``: at TP > 1, the region the group shares
    (``service.vllm_group``), which the vLLM backend registers. ``draft``: a draft model's
    pool and proposals (``attach_draft``), which the SGLang and native backends send to decodes
    that speculate. ``sglang_dsa``: a DSA model's index keys in SGLang's FP8 pages
    (``service.sglang_index``), which the SGLang backend sends; its rooms are then served.
    ``mamba``: a hybrid model's state staged for SGLang decodes (``sglang_mamba``), which then
    carry its state too. ``pins``: the engine's page pins, with which the vLLM backend
    serves a ``vllm_blocks`` pool straight from its pages (``transfer.vllm.direct``)."""
    cfg = config.transfer
    with startup_step("transfer", (ValueError,)):
        hooks = Hooks(on_reject=metrics.on_bootstrap_reject, is_engine_live=is_live, wake=wake)
        backends: dict[str, TransferBackend] = {}
        tickets = None
        mirror_layers: tuple[np.ndarray, ...] = ()
        try:
            if "native" in cfg.protocols:
                native_sliding = None
                if sliding is not None:  # a windowed pool's sliding layers read from it
                    pool_pages = windowed_pages_of(regions, sliding)
                    native_sliding = dataclasses.replace(sliding.layers, pool_pages=pool_pages)
                backends["native"] = _native_backend(
                    config, regions, hooks, state, draft, native_sliding
                )
            if "sglang" in cfg.protocols:
                layers = sglang_sliding(sliding, windowed_pages_of(regions, sliding))
                sglang = _sglang_options(config, layers, mamba)
                backends["sglang"] = make_sglang_backend(regions, sglang, hooks, draft, sglang_dsa)
            if "vllm" in cfg.protocols:
                versions = tuple(cfg.vllm_versions)
                modes = tuple(cfg.vllm_transfer_modes)
                max_open, needs_groups = config.http_api.max_inflight_requests, sliding is not None
                linear = state is not None and state.component.kind == LINEAR_STATE
                tickets = Tickets(
                    max_open, versions, modes, needs_kv_groups=needs_groups, has_linear_state=linear
                )
                linear_state = state if linear else None
                pool_pages = windowed_pages_of(regions, sliding)
                num_layers = regions.layout.num_layers
                options = _vllm_options(config, sliding, linear_state, num_layers, pool_pages)
                vllm = make_vllm_backend(regions, options, tickets, hooks, vllm_staging, pins)
                backends["vllm"] = vllm
                metrics.registry.register(VllmPullCollector(vllm.desk, vllm.pusher))
                mirror_layers = vllm.mirror_layers
        except BaseException:
            for backend in backends.values():
                backend.close()
            raise
        if state is not None:
            sglang_carries = sglang_dsa is not None or mamba is not None
            carriers = STATE_CARRIERS | ({"sglang"} if sglang_carries else set())
            if linear_vllm(state, backends):  # vLLM 0.34 pulls carry a linear model's state
                # (its mamba groups): its tickets refuse the other versions and modes
                carriers = carriers | {"vllm"}
            backends, refused = guard_backends(backends, state.component.kind, carriers)
            if refused:
                log.warning(
                    "hybrid model: the %s protocol(s) carry no %s state; each of their "
                    "requests is refused when its decode claims it (state_unsupported)",
                    ", ".join(refused),
                    state.component.kind,
                )
        if sliding is not None:
            backends = guard_unproven(backends)
            log.warning(
                "sliding-window model: the native and sglang protocols serve it, and vLLM "
                "0.34 pull decodes (its KV-cache groups); other protocols refuse each room "
                "(swa_unsupported)"
            )
        return serve_protocols(backends, tickets, mirror_layers)


def attach_kv_mirror(transfer: Transfer, kv_cache: KVCache) -> None:
    """vLLM's staging region as the pool's mirror, when vLLM decodes are served: the forward
    writes the staging blocks of the chunks their senders mirror (docs/vllm.md, "Layout")."""
    if not transfer.mirror_layers:
        return
    with startup_step("kv mirror", (ValueError,)):
        dtype = KV_TORCH_DTYPES[kv_cache.layout.dtype]
        kv_cache.attach_mirror(KVMirror(transfer.mirror_layers, dtype))


def _limits(config: Config) -> BootstrapLimits:
    return BootstrapLimits(config.transfer.max_peer_pages, config.transfer.max_message_bytes)


@dataclass(frozen=True, slots=True)
class SlidingModel:
    """A sliding-window model, as ``start_transfer`` needs it (``sliding_model``)."""

    architecture: str
    layers: SlidingLayers


def sliding_model(info: ModelInfo) -> SlidingModel | None:
    """The model's sliding layers and what a decode keeps of them; None for other models."""
    if info.sliding_window is None:
        return None
    window = decode_window_tokens(info.sliding_window)
    layers = SlidingLayers(info.sliding_layers, info.num_layers, window)
    return SlidingModel(info.architecture, layers)


def windowed_pages_of(regions: KVRegions, sliding: SlidingModel | None) -> int:
    """A windowed sliding pool's page count (``KVRegions.layer_pages``); 0 without one."""
    if sliding is None or not regions.layer_pages:
        return 0
    return regions.layer_pages[sliding.layers.sliding[0]]


def sglang_sliding(sliding: SlidingModel | None, pool_pages: int = 0) -> SlidingLayers | None:
    """What SGLang decodes get of a sliding model: its layers where SGLang runs the model on
    a hybrid SWA pool (gpt-oss; not Gemma 3), else None (every decode a full pool). With a
    windowed sliding pool of ``pool_pages`` pages the layers name it; a model whose SGLang
    decodes hold a full pool cannot be served from one (``ValueError``)."""
    if sliding is None or sliding.architecture not in HYBRID_SWA_ARCHITECTURES:
        if pool_pages:
            raise ValueError(
                f"cache.sliding_pool windowed: SGLang runs {sliding and sliding.architecture} "
                "on a full pool (no hybrid SWA memory), whose decodes want every sliding "
                "page; use sliding_pool full"
            )
        return None
    return dataclasses.replace(sliding.layers, pool_pages=pool_pages)


def sglang_mamba(config: Config, runner: ModelRunner) -> StagedState | None:
    """A hybrid linear-attention model's state slots staged in SGLang's mamba layout, when
    SGLang decodes are served (``sglang.mamba``); None otherwise. A TP group's leader stages
    from its pool of whole slots (``model.state_gather``, filled before the engine hands the
    request its aux row), and its SGLang backend alone writes every decode rank its state (its
    share at attention TP > 1); the followers write their KV heads only."""
    runner = local_runner(runner)
    if "sglang" not in config.transfer.protocols or not isinstance(runner, Runner):
        return None
    model = runner.model
    if not isinstance(model, Qwen3NextLM):
        return None
    cache = model.state if model.gather is None else model.gather.whole
    assert cache is not None, "the leader holds the whole slots"
    dtype = config.transfer.sglang_mamba_conv_dtype
    layers, device = cache.spec.linear_layers, pool_device(cache.device)
    spec = cache.spec
    groups = ((spec.key_dim, spec.num_k_heads),) * 2 + ((spec.value_dim, spec.num_v_heads),)
    conv_groups = tuple(channels for channels, _ in groups)
    stage = MambaStage(layers, cache.conv, cache.recurrent, dtype, device, conv_groups)
    log.info("sglang: mamba state staging, %d bytes beside the state pool", stage.num_bytes)
    return StagedState(spec.full_layers, stage, groups, spec.num_v_heads)


def _sglang_options(
    config: Config, sliding: SlidingLayers | None = None, mamba: StagedState | None = None
) -> SglangOptions:
    cfg = config.transfer
    agent_name = None if cfg.agent_name is None else f"{cfg.agent_name}-sglang"
    nixl = NixlOptions(
        agent_name,
        tuple(cfg.nixl_backends),
        cfg.resolved_sglang_ucx_net_devices,
        config.tracing.enabled,
    )
    return SglangOptions(
        cfg.sglang_bootstrap_bind,
        cfg.resolved_sglang_rank_ip,
        cfg.sglang_rank_port,
        cfg.sglang_kv_cache_dtype,
        write_timeout_s=cfg.peer_timeout_s,
        want_timeout_s=config.scheduler.bootstrap_timeout_s,
        health_stale_s=cfg.sglang_health_stale_s,
        allowed_networks=tuple(cfg.sglang_allowed_networks),
        rejoin_s=cfg.sglang_rejoin_s,
        nixl=nixl,
        limits=_limits(config),
        sliding=sliding,
        mamba=mamba,
    )


def linear_vllm(state: StateRegions, backends: Mapping[str, TransferBackend]) -> bool:
    """Whether the vLLM backend serves this hybrid model's state (a linear-attention one)."""
    return "vllm" in backends and state.component.kind == LINEAR_STATE


def _vllm_options(
    config: Config,
    sliding: SlidingModel | None = None,
    state: StateRegions | None = None,
    num_kv_layers: int = 0,
    window_pages: int = 0,
) -> VllmOptions:
    """``window_pages``: a windowed sliding pool's page count (0: a full pool)."""
    cfg = config.transfer
    window = None
    if sliding is not None and window_pages:
        window = dataclasses.replace(sliding.layers, pool_pages=window_pages)
    agent_name = None if cfg.agent_name is None else f"{cfg.agent_name}-vllm"
    model = cfg.vllm_model or config.http_api.served_model_name or config.model.path
    return VllmOptions(
        cfg.vllm_side_channel_host,
        cfg.vllm_side_channel_port,
        cfg.vllm_block_size,
        cfg.vllm_staging_blocks,
        lease_s=cfg.vllm_lease_s,
        read_grace_s=cfg.vllm_read_grace_s,
        engine_id=cfg.vllm_engine_id,
        identity=VllmIdentity(
            model,
            cfg.vllm_attention_backend,
            cfg.vllm_kv_cache_dtype,
            config.model.dtype if cfg.vllm_kv_cache_dtype != "auto" else None,
        ),
        versions=tuple(cfg.vllm_versions),
        modes=tuple(cfg.vllm_transfer_modes),
        nixl=NixlOptions(agent_name, tuple(cfg.nixl_backends), cfg.resolved_ucx_net_devices),
        groups=_vllm_groups(sliding, state, num_kv_layers, cfg.vllm_block_size),
        state=state,
        state_ssm_dtype="float32"
        if state is None
        else decode_ssm_dtype(
            cfg.vllm_mamba_ssm_dtype, config.model.path, state.component.tensors[0].dtype
        ),
        window=window,
    )


def _vllm_groups(
    sliding: SlidingModel | None, state: StateRegions | None, num_kv_layers: int, block_size: int
) -> VllmGroups | None:
    """vLLM 0.34's KV-cache groups of a hybrid model (``transfer.vllm.groups``)."""
    if sliding is not None:
        return sliding_groups(sliding.layers, sliding.architecture, block_size)
    if state is None:
        return None
    linear = state.component.layer_ids
    num_layers = len(linear) + num_kv_layers
    return linear_groups(linear, num_layers, block_size)


def _native_backend(
    config: Config,
    regions: KVRegions,
    hooks: Hooks,
    state: StateRegions | None,
    draft: DraftSide | None = None,
    sliding: SlidingLayers | None = None,
) -> TransferBackend:
    cfg = config.transfer
    curve = None
    if cfg.curve_secret_key_file:
        curve = CurveServerKeys.from_files(
            cfg.curve_secret_key_file, cfg.curve_authorized_keys_dir or ""
        )
    options = NativeOptions(
        cfg.bootstrap_bind,
        cfg.peer_timeout_s,
        cfg.heartbeat_interval_s,
        want_timeout_s=config.scheduler.bootstrap_timeout_s,
        nixl=NixlOptions(
            cfg.agent_name,
            tuple(cfg.nixl_backends),
            cfg.resolved_ucx_net_devices,
            config.tracing.enabled,  # NIXL's telemetry for the transfer span
        ),
        limits=_limits(config),
        curve=curve,
    )
    return make_backend(regions, options, hooks, state, draft, sliding)


def kv_event_groups(info: ModelInfo, layout: KVLayout) -> tuple[EventGroup, ...]:
    """The KV-cache groups the KV events announce a cached page in: the model's full-attention
    groups, numbered as a vLLM 0.34 decode numbers them (``_vllm_groups``); a model of one
    kind of layer is group 0. A sliding group's page is no reusable prefix (its early
    positions leave the window) and a linear group holds state, not KV: neither is announced
    (docs/kv-events.md, "KV-cache groups")."""
    kind = MLA_ATTENTION if layout.kind == MLA else FULL_ATTENTION
    linear = info.state_regions
    if linear is not None and linear.component.kind != LINEAR_STATE:
        linear = None  # a DSA model's index keys live in its pages: one MLA group
    groups = _vllm_groups(sliding_model(info), linear, layout.num_layers, layout.page_size)
    if groups is None:
        return (EventGroup(0, kind),)
    return tuple(EventGroup(g, kind) for g in groups.full_groups)


def start_kv_events(
    config: Config, metrics: WorkerMetrics, groups: tuple[EventGroup, ...] = DENSE
) -> KVEventPublisher | None:
    """The KV-event publisher, bound and publishing, announcing ``groups``
    (``kv_event_groups``); None when ``kv_events.enabled`` is off."""
    cfg = config.kv_events
    if not cfg.enabled:
        return None
    with startup_step("kv events", (KVEventsError,)):
        publisher = KVEventPublisher(
            cfg.publish_bind,
            cfg.replay_bind,
            topic=cfg.topic,
            max_queued_events=cfg.max_queued_events,
            num_replay_batches=cfg.num_replay_batches,
            observer=KVEventsTelemetry(metrics),
            groups=groups,
        )
        publisher.start()
    return publisher


def make_engine(
    config: Config,
    runner: ModelRunner,
    transfer: TransferBackend,
    pools: tuple[PagePool, AuxPool],
    sink: Callable[[Outcome], None],
    metrics: WorkerMetrics,
    prefix_cache: PrefixCache,
    tracer: RequestTracer | None = None,
    pins: PagePins | None = None,
    sliding: SlidingPageTable | None = None,
) -> Engine:
    cfg = config
    pages, aux = pools
    with startup_step("engine"):
        limits = EngineLimits(
            page_size=cfg.cache.page_size,
            chunk_size=cfg.scheduler.chunk_size,
            max_batch_tokens=cfg.scheduler.max_batch_tokens,
            max_running_requests=cfg.scheduler.max_running_requests,
            bootstrap_timeout_s=cfg.scheduler.bootstrap_timeout_s,
            transfer_timeout_s=cfg.scheduler.transfer_timeout_s,
            optimistic_prefill=cfg.scheduler.optimistic_prefill,
            optimistic_attempts=cfg.scheduler.optimistic_attempts,
            optimistic_hold_s=cfg.scheduler.optimistic_hold_s,
            optimistic_share=cfg.scheduler.optimistic_share,
        )
        return Engine(
            runner,
            transfer,
            EngineKV(pages, aux, prefix_cache, sliding, pins=pins),
            sink,
            limits,
            overlap=cfg.scheduler.overlap,
            observer=EngineEvents(metrics, log, tracer),
        )


def start_ingress(
    config: Config,
    inbox: Inbox,
    load: LoadSource,
    limits: tuple[int, int, int],
    metrics: WorkerMetrics,
    on_drain: Callable[[], None],
) -> Ingress:
    """``limits``: the vocabulary size, the longest prompt, the pool's size in tokens."""
    cfg = config.ingress
    vocab_size, max_prompt_tokens, pool_tokens = limits
    with startup_step("ingress", (ValueError, OSError)):
        curve = None
        if cfg.curve_secret_key_file:
            curve = CurveServerKeys.from_files(
                cfg.curve_secret_key_file, cfg.curve_authorized_keys_dir or ""
            )
        ingress = Ingress(
            cfg.bind,
            inbox,
            load,
            vocab_size=vocab_size,
            max_prompt_tokens=max_prompt_tokens,
            max_pool_tokens=pool_tokens,
            max_inflight=config.scheduler.max_queued_requests,
            max_message_bytes=cfg.max_message_bytes,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            curve=curve,
            observer=IngressEvents(metrics),
            on_drain=on_drain,
            allow_drain_message=cfg.allow_drain_message,
            ttft_slo_s=config.admission.ttft_slo_s,
        )
        ingress.start()
    return ingress


def start_http_api(
    config: Config,
    inbox: Inbox,
    engine: Engine,
    served: tuple[ModelInfo, Limits],
    metrics: WorkerMetrics,
    is_live: Callable[[], bool],
    tickets: Tickets | None = None,
) -> HttpApi:
    """The SGLang-compatible HTTP front (``http_api.enabled``), serving from now on; 503 until
    the daemon calls ``set_ready``."""
    cfg, limits = config.http_api, served[1]
    with startup_step("http api", (ValueError, OSError)):
        codec = load_text_codec(config.model.path)
        front = HttpApi(
            cfg.bind,
            inbox,
            lambda: engine.load,
            limits,
            served_model(config, served, has_tokenizer=codec is not None),
            codec,
            max_inflight=cfg.max_inflight_requests,
            max_body_bytes=cfg.max_body_bytes,
            is_live=is_live,
            metrics_text=lambda: generate_latest(metrics.registry),
            on_reject=metrics.on_reject,
            tickets=tickets,
        )
        front.start()
    return front


def served_model(
    config: Config, served: tuple[ModelInfo, Limits], *, has_tokenizer: bool
) -> ServedModel:
    """What the HTTP front says about the worker on its probes (``/server_info`` and kin)."""
    (info, limits), bootstrap_port = served, config.transfer.bootstrap_bind.rpartition(":")[2]
    return ServedModel(
        served_model_name=config.http_api.served_model_name or config.model.path,
        model_path=config.model.path,
        architectures=(info.architecture,),
        model_type=info.architecture.removesuffix("ForCausalLM").lower(),
        context_length=limits.max_prompt_tokens,
        page_size=config.cache.page_size,
        max_total_tokens=limits.max_pool_tokens,
        max_running_requests=config.scheduler.max_running_requests,
        version=__version__,
        bootstrap_port=int(bootstrap_port) if bootstrap_port.isdigit() else None,
        has_tokenizer=has_tokenizer,
        tp_size=config.parallel.tp_size,
    )


def write_ready_file(path: Path, endpoints: Mapping[str, object]) -> None:
    """JSON, replaced atomically: a reader sees the old file or the whole new one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(dict(endpoints), indent=1) + "\n")
    partial.replace(path)


def attach_draft(runner: object, num_aux_rows: int) -> DraftSide | None:
    """A drafting runner's side of the push: its proposals kept by aux row from now on, and
    its pool; None for a runner without a draft."""
    if not isinstance(runner, DraftingRunner):
        return None
    rows = DraftRows(num_aux_rows, runner.hidden_bytes)
    runner.draft_rows = rows
    return DraftSide(runner.draft_kv.regions(rows.base_addr, rows.num_rows), rows)


def _draft_args(config: Config) -> dict[str, object]:
    """The draft's keywords to the builder, when one is configured."""
    if config.model.draft == "none":
        return {}
    model = config.model
    return {"draft": model.draft, "draft_topk": model.draft_topk, "draft_path": model.draft_path}
