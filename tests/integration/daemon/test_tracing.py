"""Request traces from a real worker process, as a real OTLP/HTTP receiver on 127.0.0.1 gets
them (docs/observability.md): one root span per request, the child of the router's span when it
sent a W3C trace context (ZMQ field or HTTP headers), its phases end to end beneath it, and the
outcome as the root's status; export failures are counted, never waited for."""

from __future__ import annotations

import itertools
import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prefill_worker.request import FinishReason, OutcomeStatus
from prefill_worker.testing.otlp import OtlpReceiver, ReceivedSpan
from prefill_worker.transfer import RoomState
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import PAGE_SIZE, Decode, Worker, free_port, start_worker
from tests.integration.daemon.test_http_api import api_settings
from tests.patience import patient
from tests.polling import wait_until

ROUTER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ROUTER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{ROUTER_TRACE}-{ROUTER_SPAN}-01"
PHASES = ["prefill_bootstrap", "prefill_waiting", "prefill_forward", "prefill_transfer_kv_cache"]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    otlp = OtlpReceiver()
    yield otlp
    otlp.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, checkpoint, receiver) -> Iterator[tuple[Worker, int]]:  # type: ignore[no-untyped-def]
    api_port = free_port()
    worker = start_worker(
        tmp_path_factory.mktemp("traced-worker"),
        checkpoint,
        "tracing.enabled=true",
        f"tracing.endpoint={receiver.endpoint}",
        "tracing.service_name=traced-prefill",
        "tracing.schedule_delay_s=0.05",
        "scheduler.bootstrap_timeout_s=1.0",
        "scheduler.optimistic_prefill=false",  # chunks inside prefill_forward, none unclaimed
        *api_settings(api_port),
    )
    try:
        worker.child.wait_ready(120)
        yield worker, api_port
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def _tree(
    receiver: OtlpReceiver, room: int, num_chunks: int = 0
) -> tuple[ReceivedSpan, list[ReceivedSpan], list[ReceivedSpan]]:
    """The root span of ``room``'s request, its phases and its ``num_chunks`` forward chunks,
    once all have arrived."""

    def root_of(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        roots = [s for s in spans if s.attributes.get("bootstrap_room") == hex(room)]
        return roots[0] if roots else None

    def complete(spans: list[ReceivedSpan]) -> bool:
        root = root_of(spans)
        if root is None:
            return False
        children = [s for s in spans if s.parent_span_id == root.span_id]
        if num_chunks < 0:  # any number: the phases are enough
            return len([c for c in children if c.name != "chunked_prefill"]) >= 1
        return len(children) == _num_phases(root) + num_chunks

    spans = receiver.wait_for(complete)
    root = root_of(spans)
    assert root is not None
    children = sorted((s for s in spans if s.parent_span_id == root.span_id), key=_start)
    chunks = [c for c in children if c.name == "chunked_prefill"]
    return root, [c for c in children if c.name != "chunked_prefill"], chunks


def _num_phases(root: ReceivedSpan) -> int:
    return 4 if root.status_code == 1 else 1  # ok: every phase; a bootstrap timeout: the first


def _start(span: ReceivedSpan) -> int:
    return span.start_ns


def _served(decode: Decode, room: int, num_tokens: int, send: Callable[[], Any]) -> Any:
    """``send()``'s answer while the decode asks for ``room`` and takes its KV (it must keep
    polling its receiver, or the worker counts it lost); the room's status at the decode in
    ``decode.ended``."""
    decode.want(room, num_tokens)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        decode.ended = decode.wait([room])  # type: ignore[attr-defined]
        result = answer.result(timeout=patient(60))
    decode.close()
    return result


def test_a_request_is_one_trace_under_the_routers_span(traced, receiver, router_factory) -> None:
    worker, _ = traced
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    room, ids = 0x5EED0001, prompt(37, seed=1)
    result = _served(
        decode,
        room,
        len(ids),
        lambda: router.prefill(ids, room, traceparent=TRACEPARENT, request_id="traced-ok"),
    )
    assert result.status is OutcomeStatus.OK, result

    root, children, chunks = _tree(receiver, room, num_chunks=3)
    assert root.service_name == "traced-prefill"
    assert (root.trace_id, root.parent_span_id) == (ROUTER_TRACE, ROUTER_SPAN)
    assert re.fullmatch(r"prefill Req .{8}", root.name), root.name
    assert root.attributes["rid"].endswith("traced-ok")
    assert root.attributes["module"] == "request"
    assert root.attributes["num_prompt_tokens"] == 37
    assert (root.status_code, root.attributes["finish_reason"]) == (1, "ok")
    assert [c.name for c in children] == PHASES
    assert all(c.trace_id == ROUTER_TRACE for c in children)
    # laid end to end from the root's start to its end
    assert children[0].start_ns == root.start_ns
    for before, after in itertools.pairwise(children):
        assert before.end_ns == after.start_ns
    assert children[-1].end_ns == root.end_ns
    total_s = (root.end_ns - root.start_ns) / 1e9
    timings = result.timings
    phases_s = timings.bootstrap_s + timings.queue_s + timings.prefill_s + timings.transfer_s
    assert total_s == pytest.approx(phases_s, abs=1e-5)
    forward, transfer = children[2], children[3]
    assert forward.attributes["num_computed_tokens"] == 37
    # what landed: 10 pages of 4 tokens in tiny-test's 4 layer-major regions (2 layers, K and V)
    # over three writes as the chunks were computed, and the aux row in a fourth; tracing on
    # asks NIXL to measure each write, and the span has its sums
    pages = -(-37 // PAGE_SIZE)
    assert transfer.attributes["transfer_writes"] == 3 + 1
    assert transfer.attributes["transfer_descriptors"] == pages * 4 + 1
    assert transfer.attributes["transfer_bytes"] > 0
    assert transfer.attributes["nixl_post_us"] >= 0 and transfer.attributes["nixl_xfer_us"] >= 0
    # tiny-test's chunks are 16 tokens: each forward that computed one, inside the forward phase
    spans = [(c.attributes["start_token"], c.attributes["end_token"]) for c in chunks]
    assert spans == [(0, 16), (16, 32), (32, 37)]
    assert all(forward.start_ns <= c.start_ns < c.end_ns <= forward.end_ns for c in chunks)
    # the decode is told the worker's span, to continue the trace from it
    status = decode.ended[room]  # type: ignore[attr-defined]
    assert status.state is RoomState.DONE
    assert status.traceparent == f"00-{ROUTER_TRACE}-{root.span_id}-01"
    # the outcome's log line names the trace
    assert f"trace_id={ROUTER_TRACE}" in worker.log()


def test_a_failed_request_has_an_error_status_naming_the_reason(
    traced, receiver, router_factory
) -> None:
    worker, _ = traced
    router = router_factory(worker.ingress)
    room = 0x5EED0002  # no decode ever asks for it: the bootstrap times out
    result = router.prefill(prompt(9, seed=2), room, request_id="traced-timeout")
    assert result.status is OutcomeStatus.FAILED, result

    root, children, _ = _tree(receiver, room)
    assert root.parent_span_id == ""  # no traceparent: a root of its own
    assert root.trace_id != ROUTER_TRACE
    assert root.status_code == 2
    assert root.status_message.startswith("bootstrap_timeout"), root.status_message
    assert [c.name for c in children] == ["prefill_bootstrap"]
    assert f"trace_id={root.trace_id}" in worker.log()


def test_a_refused_push_and_an_abort_are_errors_naming_their_reasons(
    traced, receiver, router_factory
) -> None:
    worker, _ = traced
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    refused, ids = 0x5EED0006, prompt(40, seed=6)
    decode.want(refused, 8)  # two pages for a prompt of ten: the worker cannot push it
    result = router.prefill(ids, refused, request_id="traced-refused")
    decode.close()
    assert (result.status, result.reason) == (OutcomeStatus.FAILED, FinishReason.TRANSFER_FAILED)
    root, _, _ = _tree(receiver, refused, num_chunks=-1)
    assert root.status_code == 2
    assert root.status_message.startswith(f"{result.reason.value}: "), root.status_message
    assert root.attributes["finish_reason"] == result.reason.value

    aborted = 0x5EED0007  # no decode: it waits in bootstrap until the router withdraws it
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(router.prefill, prompt(6, seed=7), aborted, request_id="gone")
        wait_until(lambda: _queued(worker) >= 1, 10.0, "the request held")
        router.abort("gone")
        assert answer.result(timeout=patient(30)).status is OutcomeStatus.ABORTED
    root, _, _ = _tree(receiver, aborted)
    assert root.status_code == 2
    assert root.status_message.startswith("aborted_by_router"), root.status_message


def _queued(worker: Worker) -> float:
    text = worker.http("/metrics")[1]
    found = re.findall(
        r'^prefill_worker_queue_requests\{state="bootstrapping"\} (\S+)$', text, re.M
    )
    return float(found[0]) if found else 0.0


def test_the_http_front_continues_the_traceparent_header(traced, receiver) -> None:
    worker, api_port = traced
    decode = Decode(worker.bootstrap)
    room, ids = 0x5EED0003, prompt(21, seed=3)
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 1,
        "bootstrap_room": room,
    }
    other_trace = "0af7651916cd43dd8448eb211c80319c"
    headers = {
        "Content-Type": "application/json",
        "traceparent": f"00-{other_trace}-b7ad6b7169203331-01",
        "tracestate": "smg=1",
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{api_port}/generate", json.dumps(body).encode(), headers
    )

    def send() -> int:
        with urllib.request.urlopen(request, timeout=patient(60)) as response:
            return response.status

    assert _served(decode, room, len(ids), send) == 200

    root, children, _ = _tree(receiver, room, num_chunks=2)
    assert (root.trace_id, root.parent_span_id) == (other_trace, "b7ad6b7169203331")
    assert root.attributes["rid"].startswith("http:")
    assert [c.name for c in children] == PHASES


def test_a_malformed_traceparent_starts_a_new_trace(traced, receiver, router_factory) -> None:
    worker, _ = traced
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    room, ids = 0x5EED0004, prompt(5, seed=4)
    result = _served(
        decode, room, len(ids), lambda: router.prefill(ids, room, traceparent="00-not-a-trace-01")
    )
    assert result.status is OutcomeStatus.OK, result
    root, _, _ = _tree(receiver, room, num_chunks=1)
    assert root.parent_span_id == ""
    assert re.fullmatch(r"[0-9a-f]{32}", root.trace_id) and int(root.trace_id, 16) != 0


def test_spans_that_cannot_be_exported_are_counted_and_requests_go_on(
    worker_factory, router_factory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    worker = worker_factory(
        "tracing.enabled=true",
        f"tracing.endpoint={dead}",
        "tracing.schedule_delay_s=0.05",
        "tracing.export_timeout_s=0.5",
    )
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    room, ids = 0x5EED0005, prompt(13, seed=5)
    result = _served(decode, room, len(ids), lambda: router.prefill(ids, room))
    assert result.status is OutcomeStatus.OK

    def dropped() -> float:
        _, text = worker.http("/metrics")
        found = re.search(
            r'^prefill_worker_trace_spans_dropped_total\{reason="export_failed"\} (\S+)$',
            text,
            re.M,
        )
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: dropped() >= 5, 30.0, "5 spans counted as dropped")
