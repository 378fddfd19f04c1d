"""Telemetry: engine and ingress events become metrics and log lines.

``EngineEvents`` implements ``scheduler.EngineObserver`` (engine thread) and ``IngressEvents``
implements ``ingress.dispatch.IngressObserver`` (I/O thread); both only record.
``KVEventsTelemetry`` implements ``kv_events.KVEventsObserver`` (counters only).
"""

from __future__ import annotations

import logging

from prefill_worker.batch import BatchPlan
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import Outcome, RequestState
from prefill_worker.service.logs import log_outcome
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.tracing import NullTracer, RequestTracer


class EngineEvents:
    """The engine's observer: metrics, the request's trace and the per-request log line (engine
    thread), which names the trace when there is one."""

    def __init__(
        self, metrics: WorkerMetrics, log: logging.Logger, tracer: RequestTracer | None = None
    ) -> None:
        self._metrics, self._log = metrics, log
        self._tracer = NullTracer() if tracer is None else tracer

    def on_outcome(self, outcome: Outcome) -> None:
        self._metrics.observe_outcome(outcome)
        log_outcome(self._log, outcome, self._tracer.finish(outcome))

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        if num_batch_tokens:
            self._metrics.observe_step(duration_s, num_batch_tokens)

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        self._tracer.on_forward(plan, started_at, ended_at)

    def on_load(self, load: LoadSnapshot) -> None:
        self._metrics.set_queue_sizes(load.queue_sizes())
        self._metrics.set_kv_pages(load.num_used_pages, load.num_total_pages, load.num_cached_pages)
        self._metrics.sliding_pages_used.set(load.num_used_sliding_pages)
        self._metrics.set_aux_rows(load.num_used_aux_rows, load.num_total_aux_rows)
        self._metrics.set_costs(load.costs)

    def on_transition(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        return None  # per-state metrics come from ``on_load``; the outcome carries the timings

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self._metrics.observe_prefix_lookup(num_query_tokens, num_hit_tokens)


class IngressEvents:
    """The ingress observer (I/O thread): reject and dropped-reply counters."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def on_reject(self, code: str) -> None:
        self._metrics.on_reject(code)

    def on_malformed(self) -> None:
        self._metrics.malformed.inc()

    def on_unroutable(self) -> None:
        self._metrics.unroutable.inc()


class KVEventsTelemetry:
    """The KV-event publisher's observer (engine and kv-events threads): its counters."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def on_published(self, num_events: int) -> None:
        self._metrics.kv_events_published.inc(num_events)

    def on_dropped(self, reason: str, num_events: int) -> None:
        self._metrics.kv_events_dropped.labels(reason).inc(num_events)

    def on_replay(self, outcome: str) -> None:
        self._metrics.kv_event_replays.labels(outcome).inc()
