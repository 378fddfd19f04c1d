"""The tracing section: OpenTelemetry spans per request, exported over OTLP/HTTP
(docs/observability.md)."""

from __future__ import annotations

from pydantic import Field

from prefill_worker.service.sections.base import Section


class TracingConfig(Section):
    """One trace per request (root span and its phases), off by default."""

    enabled: bool = Field(
        False,
        description="Export a trace per request over OTLP/HTTP. Off, the OpenTelemetry SDK is "
        "not even imported.",
    )
    endpoint: str = Field(
        "http://127.0.0.1:4318/v1/traces",
        min_length=1,
        description="The OTLP/HTTP (protobuf) traces endpoint: a collector, Jaeger or Tempo.",
    )
    service_name: str = Field(
        "prefill-worker", min_length=1, description="The resource's `service.name`."
    )
    sampling_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="The share of new traces kept (by trace id); a request whose router sent a "
        "`traceparent` follows the router's sampled flag instead.",
    )
    max_queue_size: int = Field(
        4096,
        ge=16,
        description="Spans (and finished requests) held for export at most; past it they are "
        "dropped and counted (`prefill_worker_trace_spans_dropped_total`), never waited for.",
    )
    schedule_delay_s: float = Field(
        1.0, gt=0, description="The longest a finished span waits before its batch is sent."
    )
    export_timeout_s: float = Field(10.0, gt=0, description="One OTLP export's HTTP timeout.")
