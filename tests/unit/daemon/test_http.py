"""The HTTP endpoint over a real socket: routes, status codes, drain callback and who may
call it, metrics text, clients that reset their connection."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from prefill_worker.scheduler.liveness import ForwardInProgress, Progress
from prefill_worker.service.http import AdminAccess, Health, HttpServer
from prefill_worker.service.metrics import WorkerMetrics
from tests.clocks import FakeClock
from tests.polling import wait_until

TOKEN = "t0ken-with-entropy"


@pytest.fixture
def served() -> Iterator[tuple[HttpServer, Health, FakeClock, threading.Event]]:
    clock = FakeClock(100.0)
    health = Health(livez_stale_s=5.0, clock=clock)
    registry = CollectorRegistry()
    WorkerMetrics(registry).on_reject("draining")
    drained = threading.Event()
    admin = AdminAccess(TOKEN.encode())
    server = HttpServer("127.0.0.1:0", health, registry, on_drain=drained.set, admin=admin)
    server.start()
    yield server, health, clock, drained
    server.stop()


def get(
    port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    return response.status, body


def test_readyz_follows_health(served) -> None:
    server, health, _, _ = served
    assert get(server.port, "/readyz") == (503, '{"status": "starting"}\n')
    health.endpoints = {"ingress": "tcp://127.0.0.1:5557", "pid": 42}
    health.is_ready = True
    status, body = get(server.port, "/readyz")
    assert (status, json.loads(body)) == (
        200,
        {"status": "ready", "ingress": "tcp://127.0.0.1:5557", "pid": 42},
    )
    health.is_draining = True
    status, body = get(server.port, "/readyz")
    assert (status, json.loads(body)["status"]) == (503, "draining")


def test_livez_goes_stale(served) -> None:
    server, health, clock, _ = served
    clock.now += 60.0
    assert get(server.port, "/livez") == (200, "starting\n")  # live before the engine runs
    last_turn = [clock.now]
    health.watch(lambda: Progress(last_turn[0]))
    assert get(server.port, "/livez") == (200, "live\n")
    clock.now += 6.0
    assert get(server.port, "/livez") == (
        503,
        "stuck: the engine loop has not turned for 6.0 s\n",
    )
    last_turn[0] = clock.now
    assert get(server.port, "/livez")[0] == 200


def test_livez_counts_a_forward_within_its_bound_as_busy(served) -> None:
    server, health, clock, _ = served
    started = clock.now
    # 1000 tokens at 0.02 s each, 4× margin: an 80 s bound (the floor is 60 s).
    health.watch(lambda: Progress(started, ForwardInProgress(started, 1000), 0.02))
    clock.now += 30.0
    status, body = get(server.port, "/livez")
    assert status == 200 and body.startswith("busy: a forward of 1000 tokens has run 30.0 s")
    clock.now += 51.0
    status, body = get(server.port, "/livez")
    assert status == 503 and "past its bound of 80.0 s" in body


def test_drain_needs_post_and_the_token(served) -> None:
    server, _, _, drained = served
    assert get(server.port, "/drain")[0] == 405
    status, body = get(server.port, "/drain", "POST")
    assert status == 403 and "Bearer" in body and TOKEN not in body
    for wrong in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN[:-1]}"):
        assert get(server.port, "/drain", "POST", {"Authorization": wrong})[0] == 403
    assert not drained.is_set()
    bearer = {"authorization": f"bearer {TOKEN}"}  # names and schemes are case-insensitive
    assert get(server.port, "/drain", "POST", bearer) == (202, "draining\n")
    assert drained.is_set()


@pytest.mark.parametrize(
    ("admin", "status"),
    [(AdminAccess(), 403), (AdminAccess(allow_unauthenticated=True), 202)],
)
def test_without_a_token_drain_is_off_unless_explicitly_open(
    admin: AdminAccess, status: int
) -> None:
    drained = threading.Event()
    server = HttpServer("127.0.0.1:0", Health(5.0), CollectorRegistry(), drained.set, admin)
    server.start()
    try:
        got, body = get(server.port, "/drain", "POST")
        assert got == status and drained.is_set() == (status == 202)
        if status == 403:
            assert "metrics.admin_token_file" in body
        assert get(server.port, "/livez")[0] == 200  # probes need no token
    finally:
        server.stop()


def test_admin_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert AdminAccess.from_token_file(str(path), False) == AdminAccess(TOKEN.encode())
    assert AdminAccess.from_token_file(None, True) == AdminAccess(None, True)
    path.write_text("\n")
    with pytest.raises(ValueError, match="one non-empty word"):
        AdminAccess.from_token_file(str(path), False)
    with pytest.raises(ValueError, match="cannot read"):
        AdminAccess.from_token_file(str(tmp_path / "missing"), False)


def reset(port: int, partial: bytes) -> None:
    """Connect, send ``partial``, and close with a RST rather than a FIN."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(partial)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_client_reset_logs_no_traceback(served, caplog: pytest.LogCaptureFixture) -> None:
    server, _, _, _ = served
    caplog.set_level(logging.DEBUG)
    for partial in (
        b"GET /metr",
        b"POST /drain HTTP/1.1\r\nContent-Length: 5\r\n\r\n",
        b"",
        b"GET /metrics HTTP/1.1\r\n\r\n",  # malformed (no Host), gone before the 400
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # gone while the answer is written
    ):
        reset(server.port, partial)
    wait_until(lambda: get(server.port, "/livez")[0] == 200)
    assert get(server.port, "/metrics")[0] == 200
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]


def test_metrics_and_unknown_paths(served) -> None:
    server, _, _, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == CONTENT_TYPE_LATEST
    assert 'prefill_worker_rejects_total{code="draining"} 1.0' in response.read().decode()
    conn.close()
    assert get(server.port, "/nope")[0] == 404
    assert get(server.port, "/metrics", "POST")[0] == 405
    assert get(server.port, "/livez", "HEAD") == (200, "")  # HEAD for every GET route


def test_a_malformed_request_is_a_400_without_a_traceback(
    served, caplog: pytest.LogCaptureFixture
) -> None:
    server, _, _, _ = served
    caplog.set_level(logging.DEBUG)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\n\r\n")  # HTTP/1.1 needs a Host header
        assert sock.recv(4096).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]


def test_stop_is_prompt_with_a_client_connected() -> None:
    server = HttpServer("127.0.0.1:0", Health(5.0), CollectorRegistry(), on_drain=lambda: None)
    server.start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as idle:
        idle.sendall(b"GET /liv")  # a request that never finishes
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 3.0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


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
