"""Request tracing's seam (docs/observability.md): what the rest of the process calls, and the
choice, at start-up, between no tracing and OpenTelemetry.

A request is traced from the outside in, after the fact: ``begin`` (I/O thread, when ingress
puts the request in the engine's inbox) notes its room, arrival and the router's trace
context; ``finish`` (engine thread, with the outcome) only enqueues; a tracer thread then
builds the spans from the outcome's phase timings and hands them to the exporter. The engine
thread never builds a span nor waits for an export. With ``tracing.enabled`` off the tracer is
``NullTracer`` and ``service/otel.py`` (the OpenTelemetry SDK) is never imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from prefill_worker.batch import BatchPlan
from prefill_worker.inbox import Inbox
from prefill_worker.request import Outcome, PrefillRequest, TraceContext
from prefill_worker.service.sections.tracing import TracingConfig


class RequestTracer(Protocol):
    def begin(self, request: PrefillRequest) -> TraceContext | None:
        """A request entered the engine's inbox (any thread; quick): the context of the span
        the tracer will make for it, which the request carries on (to its decode), or None
        to leave the request's own."""
        ...

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        """A forward batch computed ``plan``'s chunks (engine thread; quick: it only notes)."""
        ...

    def finish(self, outcome: Outcome) -> str | None:
        """The request ended (engine thread; never blocks): its trace id in hex when it is
        traced, else None."""
        ...

    def close(self) -> None:
        """Export what is pending (bounded by the export timeout) and stop."""
        ...


class NullTracer:
    """Traces nothing (``tracing.enabled`` off)."""

    def begin(self, request: PrefillRequest) -> TraceContext | None:
        return None

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        return None

    def finish(self, outcome: Outcome) -> str | None:
        return None

    def close(self) -> None:
        return None


class TracedInbox(Inbox):
    """The engine's inbox that tells the tracer of every request put in it, from whichever
    front (ZMQ ingress, HTTP) it came, and hands the engine the request with the context of
    the worker's span in place of the router's (the decode is told that one)."""

    def __init__(self, tracer: RequestTracer) -> None:
        super().__init__()
        self._tracer = tracer

    def _put(self, item: Any) -> None:
        if isinstance(item, PrefillRequest):
            own = self._tracer.begin(item)
            if own is not None:
                item = dataclasses.replace(item, trace_context=own)
        super()._put(item)


def start_tracer(config: TracingConfig, on_dropped: Callable[[str, int], None]) -> RequestTracer:
    """The tracer ``config`` asks for; ``on_dropped(reason, num_spans)`` counts lost spans."""
    if not config.enabled:
        return NullTracer()
    from prefill_worker.service.otel import OtlpTracer  # the SDK, only when asked for

    return OtlpTracer(config, on_dropped)
