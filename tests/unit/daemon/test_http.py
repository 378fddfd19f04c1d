"""The HTTP endpoint over a real socket: routes, status codes, drain callback, metrics text."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from prefill_worker.http import Health, HttpServer
from prefill_worker.metrics import WorkerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def served() -> Iterator[tuple[HttpServer, Health, Clock, threading.Event]]:
    clock = Clock()
    health = Health(livez_stale_s=5.0, clock=clock)
    registry = CollectorRegistry()
    WorkerMetrics(registry).on_reject("draining")
    drained = threading.Event()
    server = HttpServer("127.0.0.1:0", health, registry, on_drain=drained.set)
    server.start()
    yield server, health, clock, drained
    server.stop()


def get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(method, path)
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    return response.status, body


def test_readyz_follows_health(served) -> None:
    server, health, _, _ = served
    assert get(server.port, "/readyz") == (503, "starting\n")
    health.is_ready = True
    assert get(server.port, "/readyz") == (200, "ready\n")
    health.is_draining = True
    assert get(server.port, "/readyz") == (503, "draining\n")


def test_livez_goes_stale(served) -> None:
    server, health, clock, _ = served
    clock.now += 60.0
    assert get(server.port, "/livez")[0] == 200  # starting up: live before the engine runs
    last_turn = [clock.now]
    health.watch(lambda: last_turn[0])
    assert get(server.port, "/livez")[0] == 200
    clock.now += 6.0
    assert get(server.port, "/livez") == (503, "engine loop stalled\n")
    last_turn[0] = clock.now
    assert get(server.port, "/livez")[0] == 200


def test_drain_needs_post(served) -> None:
    server, _, _, drained = served
    assert get(server.port, "/drain")[0] == 405
    assert not drained.is_set()
    assert get(server.port, "/drain", "POST") == (202, "draining\n")
    assert drained.is_set()


def test_metrics_and_unknown_paths(served) -> None:
    server, _, _, _ = served
    status, body = get(server.port, "/metrics")
    assert status == 200
    assert 'prefill_worker_rejects_total{code="draining"} 1.0' in body
    assert get(server.port, "/nope")[0] == 404


def test_bind_failure_raises() -> None:
    health = Health(5.0)
    first = HttpServer("127.0.0.1:0", health, CollectorRegistry(), on_drain=lambda: None)
    first.start()
    try:
        second = HttpServer(f"127.0.0.1:{first.port}", health, CollectorRegistry(), lambda: None)
        with pytest.raises(OSError):
            second.start()
    finally:
        first.stop()
