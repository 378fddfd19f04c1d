"""The tracer's contract with the engine thread (docs/observability.md): off, the OpenTelemetry
SDK is not even imported; on, ``finish`` never waits for the exporter, and what cannot be held
is dropped and counted."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import time
from array import array
from collections import Counter

from prefill_worker.request import (
    FinishReason,
    Outcome,
    PrefillRequest,
    SamplingParams,
    Timings,
    TraceContext,
)
from prefill_worker.service.otel import OtlpTracer, outcome_status, phase_bounds
from prefill_worker.service.sections.tracing import TracingConfig
from prefill_worker.service.tracing import NullTracer, TracedInbox, start_tracer
from prefill_worker.testing.otlp import OtlpReceiver
from tests.polling import wait_until


def _request(n: int, trace: TraceContext | None = None) -> PrefillRequest:
    return PrefillRequest(
        f"r{n}", array("i", [1, 2, 3]), SamplingParams(), False, n, time.monotonic(),
        trace_context=trace,
    )  # fmt: skip


def _outcome(n: int, reason: FinishReason = FinishReason.OK, error: str | None = None) -> Outcome:
    timings = Timings(bootstrap_s=0.001, queue_s=0.002, prefill_s=0.003, transfer_s=0.004)
    return Outcome(f"r{n}", reason.status, reason, 3, error=error, timings=timings)


def test_off_the_sdk_is_never_imported() -> None:
    code = (
        "import sys\n"
        "from prefill_worker.service.daemon import Daemon\n"
        "from prefill_worker.service.sections.tracing import TracingConfig\n"
        "from prefill_worker.service.tracing import start_tracer\n"
        "tracer = start_tracer(TracingConfig(), lambda reason, n: None)\n"
        "print(type(tracer).__name__, sorted(m for m in sys.modules if 'opentelemetry' in m))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["NullTracer", "[]"], out.stdout + out.stderr


def test_off_finish_names_no_trace() -> None:
    assert isinstance(start_tracer(TracingConfig(), lambda r, n: None), NullTracer)
    assert NullTracer().finish(_outcome(1)) is None


def test_phases_run_end_to_end_up_to_the_last_one_reached() -> None:
    bounds = phase_bounds(10.0, _outcome(1))
    assert len(bounds) == 4
    assert bounds[0][0] == 10.0 and bounds[-1][1] == 10.0 + 0.001 + 0.002 + 0.003 + 0.004
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    timeout = Outcome("r", FinishReason.BOOTSTRAP_TIMEOUT.status, FinishReason.BOOTSTRAP_TIMEOUT, 3,
                      timings=Timings(bootstrap_s=5.0))  # fmt: skip
    assert phase_bounds(2.0, timeout) == [(2.0, 7.0)]


def test_a_failure_status_starts_with_its_typed_reason() -> None:
    status = outcome_status(_outcome(1, FinishReason.TRANSFER_FAILED, "decode refused the write"))
    assert not status.is_ok
    assert status.description == "transfer_failed: decode refused the write"
    assert outcome_status(_outcome(2)).is_ok


def test_the_inbox_tells_the_tracer_of_each_request_and_the_trace_id_is_the_routers() -> None:
    dropped: Counter[str] = Counter()
    tracer = OtlpTracer(
        TracingConfig(enabled=True, endpoint="http://127.0.0.1:9/v1/traces", export_timeout_s=0.5),
        lambda reason, n: dropped.update({reason: n}),
    )
    inbox = TracedInbox(tracer)
    try:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        inbox.put(_request(1, TraceContext(parent)))
        inbox.put(_request(2))
        assert tracer.finish(_outcome(1)) == "0af7651916cd43dd8448eb211c80319c"
        own = tracer.finish(_outcome(2))
        assert own is not None and len(own) == 32 and own != "0" * 32
        assert tracer.finish(_outcome(3)) is None  # never begun: not traced
    finally:
        tracer.close()
        inbox.close()


def test_finish_never_waits_for_a_stuck_collector_and_counts_what_it_drops() -> None:
    """A collector that accepts the connection and never answers: the engine thread's
    ``finish`` stays quick while the queues fill, and the excess is counted, not held."""
    stuck = socket.socket()
    stuck.bind(("127.0.0.1", 0))
    stuck.listen(64)
    dropped: Counter[str] = Counter()
    config = TracingConfig(
        enabled=True,
        endpoint=f"http://127.0.0.1:{stuck.getsockname()[1]}/v1/traces",
        max_queue_size=16,
        schedule_delay_s=0.01,
        export_timeout_s=2.0,
    )
    tracer = OtlpTracer(config, lambda reason, n: dropped.update({reason: n}))
    try:
        num = 400
        for n in range(num):
            tracer.begin(_request(n))
        start = time.monotonic()
        for n in range(num):
            tracer.finish(_outcome(n))
        elapsed = time.monotonic() - start
        assert elapsed < 1.0, f"{num} finish calls took {elapsed:.3f} s"
        # 5 spans each, of which the queues hold 32 at most: the rest are counted
        wait_until(lambda: dropped["queue_full"] >= num, 10.0, "drops counted")
    finally:
        stuck.close()
        tracer.close()


def test_sampling_keeps_what_the_router_sampled_and_the_ratio_of_new_roots() -> None:
    """Ratio 0: a request without a parent is not exported (and the decode is told it is not
    sampled); one under a sampled router span is, as parent-based sampling asks."""
    receiver = OtlpReceiver()
    config = TracingConfig(
        enabled=True, endpoint=receiver.endpoint, sampling_ratio=0.0, schedule_delay_s=0.01
    )
    tracer = OtlpTracer(config, lambda reason, n: None)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        own = tracer.begin(_request(1))
        assert own.traceparent.endswith("-00")
        kept = tracer.begin(_request(2, TraceContext(parent, "k=v")))
        assert kept.traceparent.startswith("00-0af7651916cd43dd8448eb211c80319c-")
        assert kept.traceparent.endswith("-01") and kept.tracestate == "k=v"
        assert tracer.finish(_outcome(1)) == own.traceparent.split("-")[1]
        tracer.finish(_outcome(2))
    finally:
        tracer.close()  # flushes what was kept
        receiver.close()
    spans = receiver.snapshot()
    assert len(spans) == 5 and {s.trace_id for s in spans} == {"0af7651916cd43dd8448eb211c80319c"}
    [root] = [s for s in spans if s.parent_span_id == "b7ad6b7169203331"]
    assert root.span_id == kept.traceparent.split("-")[2]  # the decode was told the root's id
