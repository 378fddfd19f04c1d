"""One trace from the client through the real smg 1.13 (``--enable-trace``) into the worker:
smg continues the client's W3C context, opens its own span and injects it into the request
it sends the prefill; the worker's root span, as a real OTLP/HTTP receiver gets it, is the
child of smg's span (the client's trace id, a parent that is neither empty nor the client's
span) and carries the ``bootstrap_room`` smg chose (docs/observability.md)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefill_worker.testing.launch import free_port
from prefill_worker.testing.otlp import OtlpReceiver, ReceivedSpan
from tests.checkpoints import prompt
from tests.smg.conftest import MODEL_NAME, Stack, new_stack

CLIENT_TRACE = "5a1b2c3d4e5f60718293a4b5c6d7e8f9"
CLIENT_SPAN = "1122334455667788"


@pytest.fixture
def traced_stack(tmp_path: Path, checkpoint: Path) -> Iterator[tuple[Stack, OtlpReceiver]]:
    stack = new_stack("native", tmp_path, checkpoint)
    receiver = OtlpReceiver()
    try:
        stack.start_prefill(
            "tracing.enabled=true",
            f"tracing.endpoint={receiver.endpoint}",
            "tracing.schedule_delay_s=0.05",
        )
        stack.start_decode()
        # smg's own spans go over OTLP/gRPC to a port nothing listens on: only the context
        # it injects into the prefill's request matters here.
        stack.start_router("--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{free_port()}")
        yield stack, receiver
    finally:
        for child in stack.children:
            child.kill()
        receiver.close()


def _roots(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.name.startswith("prefill Req ")]


def test_the_workers_root_span_is_the_child_of_smgs(traced_stack) -> None:  # type: ignore[no-untyped-def]
    stack, receiver = traced_stack
    body = {
        "model": MODEL_NAME,
        "input_ids": prompt(17, seed=46),
        "sampling_params": {"temperature": 0, "max_new_tokens": 2},
    }
    headers = {
        "Content-Type": "application/json",
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    }
    request = urllib.request.Request(f"{stack.router}/generate", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, response.read()

    [root] = _roots(receiver.wait_for(lambda spans: len(_roots(spans)) >= 1))
    assert root.trace_id == CLIENT_TRACE, "smg did not carry the client's trace to the worker"
    assert root.parent_span_id not in ("", CLIENT_SPAN), root.parent_span_id  # smg's own span
    assert root.attributes["bootstrap_room"].startswith("0x")
    assert int(root.attributes["bootstrap_room"], 16) >= 0
    assert root.status_code == 1
