"""OpenTelemetry request traces exported over OTLP/HTTP; imported only with ``tracing.enabled``.

Per request, one root span named and attributed as SGLang's prefill root (``prefill Req
<rid[:8]>``; ``rid``, ``module``, ``bootstrap_room`` in hex), the child of the router's span
when the request carried a ``traceparent``, and one child per phase the request reached, laid
end to end from its outcome's timings (SGLang's stage names)::

    prefill Req 1a2b3c4d ─────────────────────────────────────────────── status ok | error: reason
      prefill_bootstrap ──────┐ (handshake wait: the decode's want)
                              prefill_waiting ─┐ (admission queue)
                                               prefill_forward ──────┐ (chunks: tokens computed)
                                                                     prefill_transfer_kv_cache ──┐
      chunked_prefill ×N            (each forward that computed a chunk: when the runner ran it)

Threads: ``begin`` runs on the I/O side, ``finish`` on the engine thread and only enqueues
into a bounded queue; the ``tracer`` thread builds the spans and the SDK's batch processor
exports them on its own thread. Whatever does not fit a queue is dropped and counted.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import NoOpCounter, NoOpMeter, NoOpMeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from prefill_worker.batch import BatchPlan
from prefill_worker.request import FinishReason, Outcome, PrefillRequest, TraceContext
from prefill_worker.service.sections.tracing import TracingConfig

log = logging.getLogger("prefill_worker.service.otel")

OnDropped = Callable[[str, int], None]
PHASES = ("prefill_bootstrap", "prefill_waiting", "prefill_forward", "prefill_transfer_kv_cache")
_PROPAGATOR = TraceContextTextMapPropagator()
_STOP = None


@dataclass(frozen=True, slots=True)
class Begun:
    """What the tracer noted when a request arrived."""

    room: int
    arrival_time: float  # time.monotonic()
    parent: Context | None  # the router's span, when it sent a valid traceparent
    trace_id: int
    span_id: int  # the root span's, chosen up front so that the ids are known at once
    # (started, ended, first token, end token) of each forward chunk, noted by the engine
    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)


class OtlpTracer:
    """``RequestTracer`` over the OpenTelemetry SDK (see the module docstring)."""

    def __init__(self, config: TracingConfig, on_dropped: OnDropped) -> None:
        self._on_dropped = on_dropped
        self._ids = _PresetIds()
        self._sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=self._sampler,
            id_generator=self._ids,
        )
        exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_s)
        self._provider.add_span_processor(
            BatchSpanProcessor(
                _CountedExporter(exporter, on_dropped),
                max_queue_size=config.max_queue_size,
                max_export_batch_size=min(512, config.max_queue_size),
                schedule_delay_millis=config.schedule_delay_s * 1000,
                export_timeout_millis=config.export_timeout_s * 1000,
                meter_provider=_DropMeters(on_dropped),
            )
        )
        self._tracer = self._provider.get_tracer("prefill_worker")
        self._pending: dict[str, Begun] = {}
        self._finished: queue.Queue[tuple[Begun, Outcome] | None] = queue.Queue(
            config.max_queue_size
        )
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="tracer", daemon=True)
        self._thread.start()

    def begin(self, request: PrefillRequest) -> TraceContext:
        parent = None
        if request.trace_context is not None:
            carrier = {"traceparent": request.trace_context.traceparent}
            if request.trace_context.tracestate:
                carrier["tracestate"] = request.trace_context.tracestate
            context = _PROPAGATOR.extract(carrier)
            if trace.get_current_span(context).get_span_context().is_valid:
                parent = context
        trace_id = (
            trace.get_current_span(parent).get_span_context().trace_id
            if parent is not None
            else random.getrandbits(128) or 1
        )
        begun = Begun(
            request.bootstrap_room,
            request.arrival_time,
            parent,
            trace_id,
            random.getrandbits(64) or 1,
        )
        self._pending[request.request_id] = begun
        return self._context_of(begun, request.trace_context)

    def _context_of(self, begun: Begun, router: TraceContext | None) -> TraceContext:
        """The W3C context of the root span ``begun`` will have: sampled as the sampler will
        decide, with the router's tracestate passed on."""
        decision = self._sampler.should_sample(begun.parent, begun.trace_id, "prefill")
        flags = "01" if decision.decision.is_sampled() else "00"
        parent = f"00-{begun.trace_id:032x}-{begun.span_id:016x}-{flags}"
        return TraceContext(parent, None if router is None else router.tracestate)

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        pending = self._pending
        for chunk in plan.chunks:
            begun = pending.get(chunk.request_id)
            if begun is not None:
                begun.chunks.append((started_at, ended_at, chunk.start, chunk.end))

    def finish(self, outcome: Outcome) -> str | None:
        begun = self._pending.pop(outcome.request_id, None)
        if begun is None:
            return None
        try:
            self._finished.put_nowait((begun, outcome))
        except queue.Full:
            num_spans = 1 + len(phase_bounds(begun.arrival_time, outcome)) + len(begun.chunks)
            self._on_dropped("queue_full", num_spans)
        return f"{begun.trace_id:032x}"

    def close(self) -> None:
        try:
            self._finished.put(_STOP, timeout=1.0)
        except queue.Full:
            log.warning("tracer queue full at close; its spans are dropped")
        self._thread.join(timeout=5.0)
        self._provider.shutdown()

    def _run(self) -> None:
        while (item := self._finished.get()) is not _STOP:
            begun, outcome = item
            try:
                self._emit(begun, outcome)
            except Exception:  # the tracer's boundary: a bad span never stops the others
                log.exception("tracing request %s failed", outcome.request_id)
                self._on_dropped("build_failed", 1)

    def _emit(self, begun: Begun, outcome: Outcome) -> None:
        bounds = phase_bounds(begun.arrival_time, outcome)
        to_ns = self._to_epoch_ns
        self._ids.preset(begun.span_id, None if begun.parent is not None else begun.trace_id)
        root = self._tracer.start_span(
            f"prefill Req {outcome.request_id[:8]}",
            context=begun.parent,
            kind=SpanKind.SERVER,
            attributes=root_attributes(begun.room, outcome),
            start_time=to_ns(begun.arrival_time),
        )
        self._ids.preset(None, None)
        if root.is_recording():
            inside = trace.set_span_in_context(root)
            for name, (start, end) in zip(PHASES, bounds, strict=False):
                span = self._tracer.start_span(
                    name,
                    inside,
                    attributes=phase_attributes(name, outcome),
                    start_time=to_ns(start),
                )
                span.end(to_ns(end))
            for started, ended, first, end_token in begun.chunks:
                span = self._tracer.start_span(
                    "chunked_prefill",
                    inside,
                    attributes={"start_token": first, "end_token": end_token},
                    start_time=to_ns(started),
                )
                span.end(to_ns(ended))
            root.set_status(outcome_status(outcome))
        root.end(to_ns(bounds[-1][1] if bounds else begun.arrival_time))

    def _to_epoch_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns


def phase_bounds(arrival_time: float, outcome: Outcome) -> list[tuple[float, float]]:
    """The (start, end) of each phase in ``PHASES`` order, end to end from arrival, up to the
    last one the request spent time in (the outcome's timings add up to the whole)."""
    t = outcome.timings
    durations = (t.bootstrap_s, t.queue_s, t.prefill_s, t.transfer_s)
    reached = max((i + 1 for i, d in enumerate(durations) if d > 0), default=1)
    bounds, begin = [], arrival_time
    for duration in durations[:reached]:
        bounds.append((begin, begin + duration))
        begin += duration
    return bounds


def root_attributes(room: int, outcome: Outcome) -> dict[str, str | int]:
    return {
        "rid": outcome.request_id,
        "module": "request",
        "bootstrap_room": hex(room),
        "finish_reason": outcome.reason.value,
        "num_prompt_tokens": outcome.num_prompt_tokens,
        "num_cached_tokens": outcome.num_cached_tokens,
        "num_prefix_hit_tokens": outcome.num_prefix_hit_tokens,
        "prefill_retries": outcome.prefill_retries,
    }


def phase_attributes(name: str, outcome: Outcome) -> dict[str, int]:
    if name == "prefill_forward":
        return {"num_computed_tokens": outcome.num_computed_tokens}
    if name == "prefill_transfer_kv_cache":
        return {"transfer_bytes": outcome.transfer_bytes}
    return {}


def outcome_status(outcome: Outcome) -> Status:
    """OK, or an error whose description starts with the typed reason."""
    if outcome.reason is FinishReason.OK:
        return Status(StatusCode.OK)
    text = outcome.reason.value
    return Status(StatusCode.ERROR, f"{text}: {outcome.error}" if outcome.error else text)


class _PresetIds(RandomIdGenerator):
    """Random ids, except a root's, which ``begin`` chose (one tracer thread uses it)."""

    def __init__(self) -> None:
        self._span_id: int | None = None
        self._trace_id: int | None = None

    def preset(self, span_id: int | None, trace_id: int | None) -> None:
        self._span_id, self._trace_id = span_id, trace_id

    def generate_span_id(self) -> int:
        span_id, self._span_id = self._span_id, None
        return span_id or super().generate_span_id()

    def generate_trace_id(self) -> int:
        trace_id, self._trace_id = self._trace_id, None
        return trace_id or super().generate_trace_id()


class _CountedExporter(SpanExporter):
    """The OTLP exporter, counting the spans of a failed export as dropped."""

    def __init__(self, exporter: SpanExporter, on_dropped: OnDropped) -> None:
        self._exporter, self._on_dropped = exporter, on_dropped

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            self._on_dropped("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _DropMeters(NoOpMeterProvider):
    """The batch processor's own metrics, of which only its drops are kept (its queue full,
    or it shut down): they become ``on_dropped``."""

    def __init__(self, on_dropped: OnDropped) -> None:
        self._on_dropped = on_dropped

    def get_meter(self, name, version=None, schema_url=None, attributes=None):
        return _DropMeter(self._on_dropped, name)


class _DropMeter(NoOpMeter):
    def __init__(self, on_dropped: OnDropped, name: str) -> None:
        super().__init__(name)
        self._on_dropped = on_dropped

    def create_counter(self, name, unit="", description=""):
        return _DropCounter(self._on_dropped, name)


class _DropCounter(NoOpCounter):
    def __init__(self, on_dropped: OnDropped, name: str) -> None:
        super().__init__(name)
        self._on_dropped = on_dropped

    def add(self, amount, attributes=None, context=None):
        reason = (attributes or {}).get("error.type")
        if reason is not None:
            self._on_dropped(str(reason), int(amount))
