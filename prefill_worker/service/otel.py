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
                                          (bytes, NIXL writes and descriptors, NIXL telemetry)
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import NoOpCounter, NoOpMeter, NoOpMeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from prefill_worker.batch import BatchPlan
from prefill_worker.request import (
    FinishReason,
    Outcome,
    PrefillRequest,
    TraceContext,
    TransferStats,
)
from prefill_worker.service.sections.tracing import TracingConfig

log = logging.getLogger("prefill_worker.service.otel")

OnDropped = Callable[[str, int], None]
PHASES = ("prefill_bootstrap", "prefill_waiting", "prefill_forward", "prefill_transfer_kv_cache")
_PROPAGATOR = TraceContextTextMapPropagator()
_STOP = None
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET_STATUS = Status(StatusCode.UNSET)


@dataclass(frozen=True, slots=True)
class Begun:
    """What the tracer noted when a request arrived."""

    room: int
    arrival_time: float  # time.monotonic()
    parent: SpanContext | None  # the router's span, when it sent a valid traceparent
    trace_id: int
    span_id: int  # the root span's, chosen up front so that the ids are known at once
    is_sampled: bool  # the sampler's decision, made up front too
    # (started, ended, first token, end token) of each forward chunk, noted by the engine
    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)


class OtlpTracer:
    """``RequestTracer`` over the OpenTelemetry SDK (see the module docstring).

    The spans describe work already done, so they are made whole (``ReadableSpan``: ids,
    times, status) and handed to the batch processor, not opened and closed through the SDK's
    tracer: a third of the Python per span. The sampler decides once per request, in
    ``begin``, as the tracer would (parent-based, then by trace id)."""

    def __init__(self, config: TracingConfig, on_dropped: OnDropped) -> None:
        self._on_dropped = on_dropped
        self._sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        self._resource = Resource.create({"service.name": config.service_name})
        self._scope = InstrumentationScope("prefill_worker")
        exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_s)
        self._processor = BatchSpanProcessor(
            _CountedExporter(exporter, on_dropped),
            max_queue_size=config.max_queue_size,
            max_export_batch_size=min(512, config.max_queue_size),
            schedule_delay_millis=config.schedule_delay_s * 1000,
            export_timeout_millis=config.export_timeout_s * 1000,
            meter_provider=_DropMeters(on_dropped),
        )
        self._pending: dict[str, Begun] = {}
        self._finished: queue.Queue[tuple[Begun, Outcome] | None] = queue.Queue(
            config.max_queue_size
        )
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="tracer", daemon=True)
        self._thread.start()

    def begin(self, request: PrefillRequest) -> TraceContext:
        context, parent = None, None
        if request.trace_context is not None:
            carrier = {"traceparent": request.trace_context.traceparent}
            if request.trace_context.tracestate:
                carrier["tracestate"] = request.trace_context.tracestate
            context = _PROPAGATOR.extract(carrier)
            parent = trace.get_current_span(context).get_span_context()
            if not parent.is_valid:
                context, parent = None, None
        trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
        decision = self._sampler.should_sample(context, trace_id, "prefill")
        begun = Begun(
            request.bootstrap_room,
            request.arrival_time,
            parent,
            trace_id,
            random.getrandbits(64) or 1,
            decision.decision.is_sampled(),
        )
        self._pending[request.request_id] = begun
        flags = "01" if begun.is_sampled else "00"
        own = f"00-{trace_id:032x}-{begun.span_id:016x}-{flags}"
        router = request.trace_context
        return TraceContext(own, None if router is None else router.tracestate)

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
        if not begun.is_sampled:
            return f"{begun.trace_id:032x}"
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
        self._processor.shutdown()

    def _run(self) -> None:
        while (item := self._finished.get()) is not _STOP:
            begun, outcome = item
            try:
                for span in self._spans(begun, outcome):
                    self._processor.on_end(span)
            except Exception:  # the tracer's boundary: a bad span never stops the others
                log.exception("tracing request %s failed", outcome.request_id)
                self._on_dropped("build_failed", 1)

    def _spans(self, begun: Begun, outcome: Outcome) -> list[ReadableSpan]:
        """The request's spans, children first, its root last."""
        bounds = phase_bounds(begun.arrival_time, outcome)
        state = begun.parent.trace_state if begun.parent is not None else None
        root = SpanContext(begun.trace_id, begun.span_id, False, _SAMPLED, state)
        children = [
            (name, start, end, phase_attributes(name, outcome))
            for name, (start, end) in zip(PHASES, bounds, strict=False)
        ]
        children += [
            ("chunked_prefill", start, end, {"start_token": first, "end_token": last})
            for start, end, first, last in begun.chunks
        ]
        spans = [
            self._span(name, self._child_of(root), root, attributes, start, end)
            for name, start, end, attributes in children
        ]
        end_time = bounds[-1][1] if bounds else begun.arrival_time
        name = f"prefill Req {outcome.request_id[:8]}"
        attributes = root_attributes(begun.room, outcome)
        spans.append(
            self._span(
                name, root, begun.parent, attributes, begun.arrival_time, end_time,
                kind=SpanKind.SERVER, status=outcome_status(outcome),
            )
        )  # fmt: skip
        return spans

    def _child_of(self, root: SpanContext) -> SpanContext:
        return SpanContext(
            root.trace_id, random.getrandbits(64) or 1, False, _SAMPLED, root.trace_state
        )

    def _span(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: Mapping[str, str | int],
        start: float,
        end: float,
        kind: SpanKind = SpanKind.INTERNAL,
        status: Status = _UNSET_STATUS,
    ) -> ReadableSpan:
        return ReadableSpan(
            name,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=kind,
            status=status,
            start_time=self._to_epoch_ns(start),
            end_time=self._to_epoch_ns(end),
            instrumentation_scope=self._scope,
        )

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
        return transfer_attributes(outcome.transfer)
    return {}


def transfer_attributes(stats: TransferStats) -> dict[str, int]:
    """The writes that landed; NIXL's own measure of them where it captured one (the summed
    time NIXL took to post them and to move them, in microseconds)."""
    attributes = {
        "transfer_bytes": stats.bytes,
        "transfer_writes": stats.writes,
        "transfer_descriptors": stats.descriptors,
    }
    if stats.nixl_post_s is not None:
        attributes["nixl_post_us"] = round(stats.nixl_post_s * 1e6)
    if stats.nixl_xfer_s is not None:
        attributes["nixl_xfer_us"] = round(stats.nixl_xfer_s * 1e6)
    return attributes


def outcome_status(outcome: Outcome) -> Status:
    """OK, or an error whose description starts with the typed reason."""
    if outcome.reason is FinishReason.OK:
        return Status(StatusCode.OK)
    text = outcome.reason.value
    return Status(StatusCode.ERROR, f"{text}: {outcome.error}" if outcome.error else text)


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
