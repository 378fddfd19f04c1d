"""The HTTP endpoint: ``GET /metrics /livez /readyz`` and ``POST /drain``, asyncio on uvloop.

It runs on its own thread with its own event loop and reads only ``Health`` (a few atomically
replaced values) and the metrics registry; ``/drain`` calls the drain callback it was given.
A minimal HTTP/1.1 server: one request per connection, no body parsing beyond its length.

Mutating routes (``/drain``) are admin routes: they need ``Authorization: Bearer <token>``
when ``AdminAccess`` has a token, and answer 403 when it has none, unless it explicitly allows
anyone (local demos). The read-only routes stay open for probes and Prometheus.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
        self.endpoints: dict[str, str | int] = {}  # what the worker bound: `/readyz` shows it

    def watch(self, last_turn_at: Callable[[], float]) -> None:
        self._last_turn_at = last_turn_at

    def is_live(self) -> bool:
        if self._last_turn_at is None:
            return True
        return self._clock() - self._last_turn_at() <= self._stale_s


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """Who may call the mutating routes: holders of ``token``; without one, nobody, unless
    ``allow_unauthenticated`` (then anyone who can reach the bind)."""

    token: bytes | None = None
    allow_unauthenticated: bool = False

    @classmethod
    def from_token_file(cls, path: str | None, allow_unauthenticated: bool) -> AdminAccess:
        """Raises ``ValueError`` when the file cannot be read or holds no token."""
        if path is None:
            return cls(None, allow_unauthenticated)
        try:
            token = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the admin token: {exc.strerror}") from exc
        if not token or len(token.split()) != 1:
            raise ValueError(f"{path}: the admin token must be one non-empty word")
        return cls(token, allow_unauthenticated)

    def refusal(self, head: bytes) -> str | None:
        """None when the request may go on, else why not (the token is never echoed)."""
        if self.token is None:
            if self.allow_unauthenticated:
                return None
            return "admin routes are off: set metrics.admin_token_file"
        scheme, _, credentials = _header(head, b"authorization").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token):
            return None
        return "needs Authorization: Bearer <the token in metrics.admin_token_file>"


def _header(head: bytes, name: bytes) -> bytes:
    """The value of header ``name`` (lower case), or b"" when absent."""
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return b""


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


_REASONS = {
    200: "OK",
    202: "Accepted",
    403: "Forbidden",
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
        admin: AdminAccess = AdminAccess(),
    ) -> None:
        host, _, port = bind.rpartition(":")
        self._host = host or "127.0.0.1"
        self._port = int(port)
        self._health = health
        self._registry = registry
        self._on_drain = on_drain
        self._admin = admin
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
            await self._serve_one(reader, writer)
        except ConnectionError as exc:  # reset or broken pipe: the client's business, not ours
            log.debug("http client went away: %r", exc)
        finally:
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
        if writer.is_closing():  # reset while we read (uvloop refuses writes to it)
            log.debug("http client went away before its %d answer", response.status)
            return
        writer.write(header.encode() + response.body)
        await writer.drain()

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
        if allowed == "POST":  # every mutating route is an admin route
            refusal = self._admin.refusal(head)
            if refusal is not None:
                log.info("refused %s %s: %s", method, path, refusal)
                return _Response(403, f"forbidden: {refusal}\n".encode())
        return handler()

    def _metrics(self) -> _Response:
        return _Response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)

    def _livez(self) -> _Response:
        if self._health.is_live():
            return _Response(200, b"live\n")
        return _Response(503, b"engine loop stalled\n")

    def _readyz(self) -> _Response:
        """``{"status": "ready" | "starting" | "draining", <the bound endpoints>}``."""
        health = self._health
        status = "draining" if health.is_draining else "ready" if health.is_ready else "starting"
        body = json.dumps({"status": status, **health.endpoints}).encode() + b"\n"
        return _Response(200 if status == "ready" else 503, body, "application/json")

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
