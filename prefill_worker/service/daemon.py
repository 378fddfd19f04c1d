"""Composition root: start-up → serve → close, and the process's exit code.

With ``service/startup.py`` (the steps that build each component; at TP > 1 also
``group_startup.py`` and a follower's ``rank.py``), the only module that sees
the whole ``Config``. This module runs those steps in order, hands what runs to the
supervisor (``service/supervisor.py``: supervision, signals, drain, stop, fatal errors, the exit
code after start-up) and closes what it started. Which thread owns what is drawn in
docs/architecture.md ("Threads"); the edge threads are supervised by ``service/threads.py``.

Start-up order: HTTP (so probes see 503 while the model loads), model and KV pool, transfer
(NIXL agent and bootstrap server), KV events, engine, ingress; then ready. A failing step exits
with a line naming it: 78 for configuration problems, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, ProcessCollector

from prefill_worker import __version__
from prefill_worker.batch import ModelRunner
from prefill_worker.inbox import Inbox
from prefill_worker.ingress.http import HttpApi, is_front_id
from prefill_worker.ingress.validate import Limits
from prefill_worker.ingress.zmq_front import Ingress
from prefill_worker.kv.cache_events import CacheEventSink, NullCacheEvents
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.state_layout import PAGES
from prefill_worker.kv_events.wire import EventGroup
from prefill_worker.model import KVCache, ModelInfo, build
from prefill_worker.model.draft.runner import DraftingRunner
from prefill_worker.request import Outcome
from prefill_worker.scheduler import Engine
from prefill_worker.service.config import EX_CONFIG, Config
from prefill_worker.service.fdlimit import raise_fd_limit, start_listener_guard
from prefill_worker.service.group_startup import agree_group_loaded, lead_group, start_tp_group
from prefill_worker.service.http import Health
from prefill_worker.service.logs import configure_logging
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.rank import run_follower
from prefill_worker.service.sdnotify import SdNotifier
from prefill_worker.service.sglang_index import attach_sglang_index
from prefill_worker.service.startup import (
    LoadReport,
    ModelBuilder,
    StartupError,
    attach_draft,
    attach_kv_mirror,
    kv_event_groups,
    load_model,
    make_engine,
    make_pools,
    make_prefix_cache,
    make_sliding,
    sglang_mamba,
    sliding_model,
    start_http,
    start_http_api,
    start_ingress,
    start_kv_events,
    start_transfer,
    startup_step,
    warm_up_model,
    write_ready_file,
)
from prefill_worker.service.supervisor import (
    EngineThread,
    Serving,
    StopRequests,
    Supervisor,
    ignore_stop_signals,
)
from prefill_worker.service.threads import ThreadWatch
from prefill_worker.service.tracing import TracedInbox, start_tracer
from prefill_worker.service.vllm_group import lead_staging
from prefill_worker.tp.group import Placement
from prefill_worker.tp.leader import GroupRunner, LeaderGroup
from prefill_worker.tp.secret import group_secret
from prefill_worker.transfer.base import TransferBackend
from prefill_worker.transfer.group import GroupBackend
from prefill_worker.transfer.vllm.shared import GroupStaging

log = logging.getLogger("prefill_worker.service.daemon")

_GROUP_GRACE_S = 5.0  # followers' time to leave after the stop step, then SIGKILL
# How a leader starts its follower ranks (``service/rank.py``); tests pass their own.
RANK_COMMAND = (sys.executable, "-m", "prefill_worker.service.rank")


class Daemon:
    def __init__(
        self,
        config: Config,
        env: Mapping[str, str],
        build_model: ModelBuilder = build,
        rank_command: Sequence[str] = RANK_COMMAND,
    ) -> None:
        self.config = config
        self._build_model = build_model
        self._env, self._rank_command = env, rank_command
        self._group: LeaderGroup | None = None  # at TP > 1: the follower ranks
        self._secret = b""  # at TP > 1: what every rank proves it holds (tp.secret)
        self._vllm_staging: GroupStaging | None = None  # at TP > 1 with vLLM: shared staging
        self._drafting: DraftingRunner | None = None  # this rank's runner, with a draft model
        self.registry = CollectorRegistry()
        ProcessCollector(namespace="prefill_worker", registry=self.registry)  # fds, memory
        self.metrics = WorkerMetrics(self.registry)
        self.health = Health(
            config.metrics.livez_stale_s,
            forward_floor_s=config.metrics.livez_forward_floor_s,
            forward_margin=config.metrics.livez_forward_margin,
        )
        self.notifier = SdNotifier.from_environ(env)
        self.threads = ThreadWatch()
        self.health.watch_threads(self.threads.stopped)
        # Tracing first: the inbox tells it of each request (docs/observability.md).
        self.tracer = start_tracer(config.tracing, self.metrics.on_trace_spans_dropped)
        self._closers: list[tuple[str, Callable[[], None]]] = [("tracer", self.tracer.close)]
        self.inbox: Inbox = TracedInbox(self.tracer)
        self.stop_requests = StopRequests()
        self._wake = self.stop_requests.wake
        self._engine: Engine | None = None
        self._engine_thread: EngineThread | None = None
        self._ingress: Ingress | None = None
        self._http_api: HttpApi | None = None  # the SGLang-compatible front, when enabled
        self._kv_layout: dict[str, str | int | list[float]] = {}
        self.transfer_endpoints: Mapping[str, str] = {}
        # Where the prefix cache reports its blocks: the KV-event publisher when
        # kv_events.enabled, else a sink that drops them.
        self.cache_events: CacheEventSink = NullCacheEvents()
        self._kv_event_endpoints: dict[str, str] = {}

    # ---- start-up ---------------------------------------------------------------------

    def run(self) -> int:
        try:
            cfg = self.config.parallel
            placement = Placement.from_environ(self._env, cfg.tp_size, cfg.interface)
            if placement is not None:
                self._secret = group_secret(
                    placement.is_torchrun, placement.spans_hosts, cfg.group_secret_file
                )
        except ValueError as exc:
            log.error("start-up failed at step 'tp group': %s", exc)
            return EX_CONFIG
        if placement is not None and not placement.is_leader:  # a torchrun follower
            return run_follower(self.config, placement, self._build_model, self._secret)
        try:
            self._start(placement)
        except StartupError as exc:
            log.error("%s", exc)
            self._close()
            return exc.exit_code
        is_main = threading.current_thread() is threading.main_thread()
        if is_main:
            self.stop_requests.install_signals()
        code = self._supervisor().supervise()
        if is_main:
            ignore_stop_signals()
        self._close()
        log.info("exit %d", code)
        return code

    def _start(self, placement: Placement | None) -> None:
        cfg = self.config
        watch = self.threads.step
        with watch("http"):
            http = start_http(cfg, self.health, self.registry, self.request_drain)
        self._closers.append(("http", http.stop))
        log.info("http on %s:%d", cfg.metrics.bind.rpartition(":")[0], http.port)
        runner, kv_cache, info = self._load(placement)
        sglang_dsa = attach_sglang_index(cfg, runner, kv_cache.device_name)
        pages, aux = make_pools(cfg, kv_cache)
        pins = PagePins(pages)  # pages vLLM decodes still read from a vllm_blocks pool
        sliding = make_sliding(cfg, kv_cache, info)  # a windowed sliding pool's pages
        warm_up_model(
            cfg, runner, pages, info.vocab_size, self.metrics, self.notifier.status, sliding
        )
        regions = kv_cache.regions(aux.base_addr, aux.num_rows)
        with watch("transfer"):
            transfer = start_transfer(
                cfg,
                regions,
                self.metrics,
                self.inbox.wake,
                self.health.is_live,
                info.state_regions,
                sliding_model(info),
                self._vllm_staging,
                attach_draft(self._drafting, aux.num_rows),
                sglang_dsa,
                sglang_mamba(cfg, runner),
                pins,
            )
        self._closers.append(("transfer", transfer.backend.close))
        guard = start_listener_guard(cfg.transfer.ucx_silent_close_s, self.registry)
        if guard is not None:
            self._closers.append(("nixl listener guard", guard.stop))
        if self._vllm_staging is None:  # at TP > 1 its heads of the shared region, attached
            attach_kv_mirror(transfer, kv_cache)
        backend: TransferBackend = transfer.backend
        layout = kv_cache.layout
        # A vLLM pull needs nothing from the followers but their forwards' mirror writes,
        # done when the leader's forward returns: its senders are not mirrored.
        if self._group is not None and self._vllm_staging is None:
            # every sender mirrored to the followers, states agreed
            assert placement is not None
            if lead_group(backend, placement.size, info.num_kv_heads):
                layout = dataclasses.replace(layout, num_kv_heads=info.num_kv_heads)
            backend = GroupBackend(backend, self._group.channel.link)
        self._kv_layout = layout.summary()  # published: a decode sizes its pool by it
        self.transfer_endpoints = transfer.endpoints
        self._transfer_backend = transfer.backend  # an attention-DP leader leads its routes
        with watch("kv events"):
            self._start_kv_events(kv_event_groups(info, kv_cache.layout))
        # a hit skips the prefix's state unless that state lives in the pages (DSA's index keys)
        can_share = info.state is None or info.state.copy == PAGES
        prefix_cache = make_prefix_cache(cfg, pages, self.cache_events, can_share)
        engine = make_engine(
            cfg,
            runner,
            backend,
            (pages, aux),
            self._reply,
            self.metrics,
            prefix_cache,
            self.tracer,
            pins,
            sliding,
        )
        self._engine = engine
        limits = (
            info.vocab_size,
            min(cfg.scheduler.max_prompt_tokens, info.max_position),
            pages.num_pages * cfg.cache.page_size,
        )
        with watch("ingress"):
            self._ingress = self._start_front(engine, limits)
        # Closed before the engine's pools go: it flushes the last replies.
        self._closers.append(("ingress", self._ingress.close))
        if cfg.http_api.enabled:
            served = (info, Limits(*limits, ttft_slo_s=cfg.admission.ttft_slo_s))
            with watch("http api"):
                front = start_http_api(
                    cfg,
                    self.inbox,
                    engine,
                    served,
                    self.metrics,
                    self.health.is_live,
                    transfer.tickets,
                )
            self._http_api = front
            self._closers.append(("http api", front.stop))
            log.info("http api on %s:%d", cfg.http_api.bind.rpartition(":")[0], front.port)
        self._start_engine_thread(engine)
        self.metrics.info.info(
            {
                "version": __version__,
                "model": cfg.model.path,
                "device": info.device,
                "attention_backend": info.attention_backend,
                "moe_backend": info.moe_backend or "none",
            }
        )
        self.metrics.set_kv_pages(0, pages.num_pages)
        self.health.watch(engine.progress)
        log.info("edge threads supervised: %s", ", ".join(self.threads.watched()))
        self._announce(http.port)

    def _watch_draft(self, runner: ModelRunner) -> None:
        """A drafting runner: its forward time to the metrics, kept for the transfer."""
        if isinstance(runner, DraftingRunner):
            runner.on_draft_forward = self.metrics.on_draft_forward
            self._drafting = runner

    def _load(self, placement: Placement | None) -> tuple[ModelRunner, KVCache, ModelInfo]:
        """This rank's model; at TP > 1 the group first (followers started, joined), and
        the runner every forward of the group goes through."""
        report = LoadReport(self.notifier.status)
        if placement is None:
            runner, kv_cache, info = load_model(self.config, self._build_model, report)
            self._watch_draft(runner)
            return runner, kv_cache, info
        tp, group, device = start_tp_group(
            self.config, placement, self._rank_command, self._wake.set, self._secret
        )
        self._group = group
        # Closed after the engine's shutdown (which may still run a forward on every rank).
        self._closers.append(("tp group", lambda: group.close(_GROUP_GRACE_S)))
        self.health.watch_group(group.stuck)
        runner, kv_cache, info = load_model(
            self.config, self._build_model, report, tp=tp, device=device
        )
        agree_group_loaded(self.config, group, kv_cache.layout.num_pages)
        self._watch_draft(runner)  # the leader's: only its proposals are kept and sent
        self._vllm_staging = lead_staging(
            self.config, kv_cache, info.num_kv_heads, placement.size, group.channel
        )
        # From now on the followers wait for steps (bounded by parallel.step_timeout_s): the
        # rest of the start-up (warm-up, NIXL, the HTTP front) may take longer than that.
        self.metrics.lead_group(placement.size)
        group.channel.on_written = self.metrics.on_rank_written  # before the first step
        group.channel.on_decode_peers = self.metrics.on_rank_decode_peers
        group.start_heartbeat()
        return GroupRunner(runner, group.channel, self.metrics.on_rank_forward), kv_cache, info

    def _start_front(self, engine: Engine, limits: tuple[int, int, int]) -> Ingress:
        """Where requests come from: the router-facing ingress (a DP rank's daemon: its
        link to the leader, ``service/dp_rank.py``)."""
        load = lambda: engine.load  # noqa: E731
        on_drain = self.request_drain
        return start_ingress(self.config, self.inbox, load, limits, self.metrics, on_drain)

    def _start_kv_events(self, groups: tuple[EventGroup, ...]) -> None:
        publisher = start_kv_events(self.config, self.metrics, groups)
        if publisher is None:
            return
        # Closed after the engine's shutdown, so the cache's last events still go out.
        self._closers.append(("kv events", publisher.close))
        self.cache_events = publisher
        self._kv_event_endpoints["kv_events"] = publisher.endpoint
        if publisher.replay_endpoint is not None:
            self._kv_event_endpoints["kv_events_replay"] = publisher.replay_endpoint

    def _announce(self, http_port: int) -> None:
        """Ready: say where everything is bound (port 0 picks any) to `/readyz`, systemd, a file."""
        cfg = self.config
        http_host = cfg.metrics.bind.rpartition(":")[0] or "127.0.0.1"
        endpoints: dict[str, str | int] = {
            "ingress": self.ingress.endpoint,
            **self.transfer_endpoints,
            "http": f"{http_host}:{http_port}",
            **self._kv_event_endpoints,
            "pid": os.getpid(),
        }
        if self._http_api is not None:
            api_host = cfg.http_api.bind.rpartition(":")[0] or "127.0.0.1"
            endpoints["http_api"] = f"{api_host}:{self._http_api.port}"
        published: dict[str, object] = {
            **endpoints,
            "kv_layout": self._kv_layout,
            **self._more_endpoints(),
        }
        self.health.endpoints = published
        if cfg.daemon.ready_file:
            ready_file = Path(cfg.daemon.ready_file)
            with startup_step("ready file", (OSError,)):
                write_ready_file(ready_file, published)
            self._closers.append(("ready file", lambda: ready_file.unlink(missing_ok=True)))
        self.health.is_ready = True
        if self._http_api is not None:
            self._http_api.set_ready(True)
        self.metrics.ready.set(1)
        where = ", ".join(f"{k} {v}" for k, v in endpoints.items() if k != "pid")
        self.notifier.ready(f"serving {cfg.model.path}: {where}")
        log.info("ready: %s", where)

    def _more_endpoints(self) -> dict[str, object]:
        """What else ``/readyz`` and the ready file publish (an attention-DP leader: its
        ranks', ``service/dp_leader.py``)."""
        return {}

    def _start_engine_thread(self, engine: Engine) -> None:
        self._engine_thread = EngineThread(engine, self.inbox, self._wake.set)
        self._engine_thread.start()

    def _supervisor(self) -> Supervisor:
        assert self._engine is not None and self._engine_thread is not None
        serving = Serving(
            self._engine, self._engine_thread, self.inbox, self.ingress, self._http_api, self._group
        )
        return Supervisor(
            self.config.daemon,
            serving,
            self.stop_requests,
            self.health,
            self.metrics,
            self.notifier,
        )

    @property
    def ingress(self) -> Ingress:
        assert self._ingress is not None, "ingress starts before anything replies"
        return self._ingress

    # ---- serving ----------------------------------------------------------------------

    def request_drain(self) -> None:
        """From any thread (HTTP, ingress, signal handler): begin a graceful drain."""
        self.stop_requests.request_drain()

    def on_stop_signal(self) -> None:
        """SIGTERM or SIGINT: the first drains, a second forces the stop."""
        self.stop_requests.on_stop_signal()

    def _reply(self, outcome: Outcome) -> None:
        """Each outcome to the ingress its request came through (ids tell them apart)."""
        if self._http_api is not None and is_front_id(outcome.request_id):
            self._http_api.send_outcome(outcome)
        else:
            self.ingress.send_outcome(outcome)

    def _close(self) -> None:
        self.health.is_ready = False
        self.metrics.ready.set(0)
        for name, close in reversed(self._closers):
            try:
                close()
            except Exception:
                log.exception("closing %s failed", name)
        self.notifier.close()


def run_daemon(
    config: Config,
    env: Mapping[str, str] | None = None,
    *,
    build_model: ModelBuilder | None = None,
    rank_command: Sequence[str] | None = None,
    kind: type[Daemon] = Daemon,
) -> int:
    """``kind``: at ``parallel.dp_size`` > 1 the attention-DP leader (``cli`` picks it)."""
    configure_logging(config.daemon.log_level, config.daemon.log_format)
    raise_fd_limit()
    daemon = kind(
        config,
        os.environ if env is None else env,
        build_model or build,
        RANK_COMMAND if rank_command is None else rank_command,
    )
    return daemon.run()


__all__ = ["Daemon", "ModelBuilder", "StartupError", "run_daemon"]
