"""The running lifecycle, once start-up has ended: supervise, drain, stop, the exit code.

``Daemon`` (``service/daemon.py``) builds the worker and hands what runs to a ``Supervisor`` as
a ``Serving`` record. Stop requests (a signal, the router's ``drain``, HTTP ``/drain``) come
from any thread into ``StopRequests``, which only sets a flag and wakes the supervision loop;
the loop decides: the first request drains, a second signal forces the stop. Exit codes: 0
after a drain, 1 when a second signal forced the stop, 70 after a fatal engine error or a
failed tensor-parallel rank group (docs/parallelism.md). ``EngineThread`` runs the engine's
loop on a thread of its own and keeps what it raised for the supervisor.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Protocol

from prefill_worker.inbox import Inbox
from prefill_worker.ingress.http import HttpApi
from prefill_worker.ingress.zmq_front import Ingress
from prefill_worker.request import FinishReason
from prefill_worker.scheduler import Engine
from prefill_worker.service.http import Health
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.schema import DaemonConfig
from prefill_worker.service.sdnotify import SdNotifier

log = logging.getLogger("prefill_worker.service.daemon")

EX_OK, EX_FORCED, EX_SOFTWARE = 0, 1, 70
_SUPERVISE_PERIOD_S = 0.25


class StopRequests:
    """What was asked of the process, from any thread: a drain, or (a second signal) a stop
    now. Asking sets a flag and wakes the supervision loop (``wake``), nothing more."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self._drain_asked = threading.Event()
        self._num_signals = 0

    def request_drain(self) -> None:
        """From any thread (HTTP, ingress, signal handler): begin a graceful drain."""
        self._drain_asked.set()
        self.wake.set()

    def on_stop_signal(self) -> None:
        """SIGTERM or SIGINT: the first drains, a second forces the stop."""
        self._num_signals += 1
        self.request_drain()

    @property
    def is_drain_asked(self) -> bool:
        return self._drain_asked.is_set()

    @property
    def is_forced(self) -> bool:
        return self._num_signals > 1

    def install_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.on_stop_signal()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


def ignore_stop_signals() -> None:
    """The stop is decided: a later SIGTERM (the kubelet's, after a preStop drain that already
    ended) has nothing left to ask. Ignored, not handled: Python puts back the default action
    of a handled signal while the interpreter shuts down, and that would end the process by
    the signal instead of with its exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class EngineThread:
    """The engine's loop on a thread of its own; what it raised, if it did, for the supervisor."""

    def __init__(self, engine: Engine, inbox: Inbox, wake: Callable[[], None]) -> None:
        self._engine, self._inbox, self._wake = engine, inbox, wake
        self._stop_engine = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        try:
            self._engine.run(self._stop_engine, self._inbox)
        except BaseException as exc:  # reported and turned into exit 70 by the supervisor
            self.error = exc
        finally:
            self._wake()

    def stop(self) -> None:
        """Ask the loop to end after its current turn."""
        self._stop_engine.set()
        self._inbox.wake()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()


class RankGroup(Protocol):
    """The other ranks behind this worker, as the supervisor watches them: a TP group's
    followers (``tp.leader.LeaderGroup``) or attention-DP ranks (``dp_leader.DpRanks``)."""

    def problem(self) -> str | None: ...

    def is_busy(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Serving:
    """What start-up left running, for the supervisor to watch and stop."""

    engine: Engine
    engine_thread: EngineThread
    inbox: Inbox
    ingress: Ingress
    http_api: HttpApi | None  # the SGLang-compatible front, when enabled
    group: RankGroup | None  # at TP > 1 the follower ranks; at DP > 1 the other DP ranks


class Supervisor:
    """The supervision loop over what runs, and the drain, stop or fatal error that ends it."""

    def __init__(
        self,
        config: DaemonConfig,
        serving: Serving,
        requests: StopRequests,
        health: Health,
        metrics: WorkerMetrics,
        notifier: SdNotifier,
    ) -> None:
        self.config = config
        self._engine, self._engine_thread = serving.engine, serving.engine_thread
        self.inbox, self._ingress, self._http_api = serving.inbox, serving.ingress, serving.http_api
        self._group = serving.group
        self._requests, self._wake = requests, requests.wake
        self.health, self.metrics, self.notifier = health, metrics, notifier
        self._was_live = True

    def supervise(self) -> int:
        """Watch until the worker must stop; stop it; the exit code."""
        drain_deadline: float | None = None
        drain_floor = 0.0
        while True:
            self._wake.wait(_SUPERVISE_PERIOD_S)
            self._wake.clear()
            if self._engine_thread.error is not None:
                return self._fatal()
            if self._group is not None and self._group.problem() is not None:
                log.error("rank group failed: %s", self._group.problem())
                return self._stop(FinishReason.ENGINE_ERROR, EX_SOFTWARE)
            if self._requests.is_forced:
                log.warning("second signal: stopping now")
                return self._stop(FinishReason.DRAINING, EX_FORCED)
            if self._requests.is_drain_asked and drain_deadline is None:
                drain_deadline, drain_floor = self._begin_drain()
            if drain_deadline is not None and self._is_drained(drain_floor, drain_deadline):
                return self._stop(FinishReason.DRAINING, EX_OK)
            self._watchdog()

    def _watchdog(self) -> None:
        """Ping systemd's watchdog while live (busy counts); log each change of verdict."""
        verdict = self.health.liveness()
        if verdict.is_live:
            self.notifier.watchdog()
        if verdict.is_live != self._was_live:
            self._was_live = verdict.is_live
            log.log(
                logging.INFO if verdict.is_live else logging.ERROR, "liveness: %s", verdict.reason
            )

    def _begin_drain(self) -> tuple[float, float]:
        """Refuse new work; when the drain must end, and when it may end once idle."""
        log.info("draining: new requests are rejected, in-flight ones may finish")
        self._ingress.set_draining(True)
        if self._http_api is not None:
            self._http_api.set_draining(True)
        self.health.is_draining = True
        self.metrics.draining.set(1)
        self.notifier.stopping("draining")
        began_at, cfg = time.monotonic(), self.config
        return began_at + cfg.drain_timeout_s, began_at + cfg.drain_min_s

    def _is_drained(self, floor: float, deadline: float) -> bool:
        """Out of time, or idle once past the floor (by then the routers' health checks have
        seen the 503 and stopped sending here: the port stays open until they have)."""
        now = time.monotonic()
        return now >= deadline or (now >= floor and self._is_idle())

    def _is_idle(self) -> bool:
        """No request held: the engine turned after this check began with nothing live."""
        checked_at = time.monotonic()
        if not self.inbox.empty():
            return False
        deadline = checked_at + 1.0
        while self._engine.last_turn_at <= checked_at and time.monotonic() < deadline:
            self._wake.wait(0.005)
        is_group_idle = self._group is None or not self._group.is_busy()
        return self.inbox.empty() and self._engine.load.num_live == 0 and is_group_idle

    def _stop(self, reason: FinishReason, code: int) -> int:
        self._refuse_new()
        self._engine_thread.stop()
        while self._engine_thread.is_alive():
            self._engine_thread.join(timeout_s=_SUPERVISE_PERIOD_S)
            if self._engine_thread.is_alive() and self._requests.is_forced:
                # A forward that never returns must not hold the process: the forced stop
                # leaves without the engine (its in-flight requests get no reply).
                log.error("second signal while the engine is stuck in a forward: exiting")
                return EX_FORCED
        if self._engine_thread.error is not None:
            return self._fatal()
        self._engine.shutdown(reason, self.inbox)
        return code

    def _fatal(self) -> int:
        log.error(
            "fatal engine error: %r; every request in flight was failed", self._engine_thread.error
        )
        self._refuse_new()
        self._engine.shutdown(FinishReason.ENGINE_ERROR, self.inbox)
        return EX_SOFTWARE

    def _refuse_new(self) -> None:
        """The engine stops: new requests are refused (``draining``) instead of queued in an
        inbox nobody reads any more; what the inbox holds already, ``shutdown`` answers."""
        self._ingress.set_draining(True)
        if self._http_api is not None:
            self._http_api.set_draining(True)
