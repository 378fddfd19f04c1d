"""An OTLP/HTTP traces receiver for tests and benchmarks: a small HTTP server on 127.0.0.1
that decodes each ``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``) into
``ReceivedSpan`` records. The daemon never imports it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from prefill_worker.testing import launch

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    service_name: str
    name: str
    trace_id: str  # hex, 32 digits
    span_id: str  # hex, 16 digits
    parent_span_id: str  # hex, or "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error (OTLP's StatusCode)
    status_message: str


class OtlpReceiver:
    """``endpoint`` takes exports; ``spans`` holds every span received, in arrival order."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_exports = 0
        self._arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != TRACES_PATH:
                    self.send_error(404)
                    return
                receiver._take(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{TRACES_PATH}"

    def _take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                spans += [_span(service, span) for span in scope_spans.spans]
        with self._arrived:
            self.spans.extend(spans)
            self.num_exports += 1
            self._arrived.notify_all()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._arrived:
            return list(self.spans)

    def wait_for(self, predicate: Any, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds (checked at each export that arrives);
        AssertionError after ``timeout_s`` (times ``launch.PATIENCE``, the tests' factor)."""
        timeout_s *= launch.PATIENCE
        with self._arrived:
            if self._arrived.wait_for(lambda: predicate(self.spans), timeout_s):
                return list(self.spans)
            names = sorted({s.name for s in self.spans})
        raise AssertionError(f"no such spans in {timeout_s} s; received {names}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _span(service: str, span: Any) -> ReceivedSpan:
    return ReceivedSpan(
        service_name=service,
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=_attributes(span.attributes),
        status_code=span.status.code,
        status_message=span.status.message,
    )


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)
