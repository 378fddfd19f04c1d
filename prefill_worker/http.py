"""The HTTP endpoint: ``GET /metrics /livez /readyz`` and ``POST /drain``, asyncio on uvloop.

It runs on its own thread with its own event loop and reads only ``Health`` (a few atomically
replaced values) and the metrics registry; ``/drain`` calls the drain callback it was given.
A minimal HTTP/1.1 server: one request per connection, no body parsing beyond its length.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 16 * 1024
_READ_TIMEOUT_S = 5.0


class Health:
    """Liveness and readiness: set by the daemon, read by the HTTP thread.

    Live while starting up; once ``watch`` names the engine's last-turn clock, live only while
    the engine loop turned within ``livez_stale_s``."""

    def __init__(self, livez_stale_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stale_s = livez_stale_s
        self._clock = clock
        self._last_turn_at: Callable[[], float] | None = None
        self.is_ready = False
        self.is_draining = False

    def watch(self, last_turn_at: Callable[[], float]) -> None:
        self._last_turn_at = last_turn_at

    def is_live(self) -> bool:
        if self._last_turn_at is None:
            return True
        return self._clock() - self._last_turn_at() <= self._stale_s


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


_REASONS = {
    200: "OK",
    202: "Accepted",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    503: "Service Unavailable",
}


class HttpServer:
    """Serves the endpoint on ``host:port`` (port 0 picks one; see ``port`` after start)."""

    def __init__(
        self,
        bind: str,
        health: Health,
        registry: CollectorRegistry,
        on_drain: Callable[[], None],
    ) -> None:
        host, _, port = bind.rpartition(":")
        self._host = host or "127.0.0.1"
        self._port = int(port)
        self._health = health
        self._registry = registry
        self._on_drain = on_drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> None:
        """Bind and serve on a daemon thread; raises OSError here if the bind fails."""
        started = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._serve, args=(started, errors), name="http", daemon=True
        )
        self._thread.start()
        started.wait()
        if errors:
            raise errors[0]

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _serve(self, started: threading.Event, errors: list[BaseException]) -> None:
        loop = _new_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, self._host, self._port)
            )
        except OSError as exc:
            errors.append(exc)
            started.set()
            return
        self.port = self._server.sockets[0].getsockname()[1]
        started.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            response = self._route(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            response = _Response(400, b"bad request\n")
        header = (
            f"HTTP/1.1 {response.status} {_REASONS[response.status]}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(header.encode() + response.body)
            await writer.drain()
        writer.close()

    def _route(self, head: bytes) -> _Response:
        if len(head) > _MAX_HEADER_BYTES:
            return _Response(400, b"headers too large\n")
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        handlers: dict[str, tuple[str, Callable[[], _Response]]] = {
            "/metrics": ("GET", self._metrics),
            "/livez": ("GET", self._livez),
            "/readyz": ("GET", self._readyz),
            "/drain": ("POST", self._drain),
        }
        if path not in handlers:
            return _Response(404, b"not found\n")
        allowed, handler = handlers[path]
        if method != allowed and not (allowed == "GET" and method == "HEAD"):
            return _Response(405, f"use {allowed}\n".encode())
        return handler()

    def _metrics(self) -> _Response:
        return _Response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)

    def _livez(self) -> _Response:
        if self._health.is_live():
            return _Response(200, b"live\n")
        return _Response(503, b"engine loop stalled\n")

    def _readyz(self) -> _Response:
        if self._health.is_draining:
            return _Response(503, b"draining\n")
        if not self._health.is_ready:
            return _Response(503, b"starting\n")
        return _Response(200, b"ready\n")

    def _drain(self) -> _Response:
        self._on_drain()
        return _Response(202, b"draining\n")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed; using the default asyncio loop")
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
