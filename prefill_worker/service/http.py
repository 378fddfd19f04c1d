"""The HTTP endpoint: ``GET /metrics /livez /readyz`` and ``POST /drain``, aiohttp on uvloop.

It runs on its own thread with its own event loop and reads only ``Health`` (a few atomically
replaced values) and the metrics registry; ``/drain`` calls the drain callback it was given.
aiohttp does the HTTP: parsing, HEAD for the GET routes, 404 and 405, clients that go away.

Mutating routes (``/drain``) are admin routes: they need ``Authorization: Bearer <token>``
when ``AdminAccess`` has a token, and answer 403 when it has none, unless it explicitly allows
anyone (local demos). The read-only routes stay open for probes and Prometheus.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefill_worker.aio_site import ThreadedSite
from prefill_worker.scheduler.liveness import LivenessRule, Progress, Verdict

log = logging.getLogger(__name__)


class Health:
    """Liveness and readiness: set by the daemon, read by the HTTP thread.

    Live while starting up; once ``watch`` names the engine's progress, live by
    ``scheduler.liveness.LivenessRule``: the loop turned within ``livez_stale_s``, or a forward
    is running within its bound (``forward_margin`` × its tokens × the measured seconds per
    token, at least ``forward_floor_s``). A forward past its bound is stuck. An edge thread
    that stopped (``watch_threads``: ``service.threads.ThreadWatch.stopped``) makes the worker
    neither live nor ready, whatever the engine does."""

    def __init__(
        self,
        livez_stale_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        forward_floor_s: float = 60.0,
        forward_margin: float = 4.0,
    ) -> None:
        self._rule = LivenessRule(livez_stale_s, forward_floor_s, forward_margin)
        self._clock = clock
        self._progress: Callable[[], Progress] | None = None
        self._stopped_threads: Callable[[], list[str]] = list
        self._stuck_group: Callable[[], str | None] = lambda: None
        self.is_ready = False
        self.is_draining = False
        self.endpoints: dict[str, object] = {}  # what the worker bound: `/readyz` shows it

    def watch(self, progress: Callable[[], Progress]) -> None:
        self._progress = progress

    def watch_threads(self, stopped: Callable[[], list[str]]) -> None:
        self._stopped_threads = stopped

    def watch_group(self, stuck: Callable[[], str | None]) -> None:
        """At TP > 1: why the rank group is stuck or lost (``tp.leader.LeaderGroup.stuck``)."""
        self._stuck_group = stuck

    def stopped_threads(self) -> list[str]:
        return self._stopped_threads()

    def liveness(self) -> Verdict:
        stopped = self._stopped_threads()
        if stopped:
            return Verdict(False, f"stuck: edge thread stopped: {', '.join(stopped)}")
        group = self._stuck_group()
        if group is not None:
            return Verdict(False, f"stuck: {group}")
        if self._progress is None:
            return Verdict(True, "starting")
        return self._rule.judge(self._progress(), self._clock())

    def is_live(self) -> bool:
        return self.liveness().is_live


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

    def refusal(self, authorization: str) -> str | None:
        """None when a request with this ``Authorization`` header may go on, else why not (the
        token is never echoed)."""
        if self.token is None:
            if self.allow_unauthenticated:
                return None
            return "admin routes are off: set metrics.admin_token_file"
        scheme, _, credentials = authorization.partition(" ")
        offered = credentials.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() == "bearer" and hmac.compare_digest(offered, self.token):
            return None
        return "needs Authorization: Bearer <the token in metrics.admin_token_file>"


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
        self._site = ThreadedSite("http")
        self.port = 0

    def start(self) -> None:
        """Bind and serve on a daemon thread; raises OSError here if the bind fails."""
        self.port = self._site.start(self._app(), self._host, self._port, logger=_ServerLog())

    def stop(self) -> None:
        """Close the listener and every connection (in-flight requests get a moment)."""
        self._site.stop()

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_post("/drain", self._drain)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _livez(self, request: web.Request) -> web.Response:
        """200 when live (busy counts), 503 when stuck; the body says which and why."""
        verdict = self._health.liveness()
        return web.Response(status=200 if verdict.is_live else 503, text=verdict.reason + "\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        """``{"status": "ready" | "starting" | "draining" | "failed", <the bound endpoints>}``;
        ``failed`` (an edge thread stopped) names the threads under ``"stopped"``."""
        health = self._health
        stopped = health.stopped_threads()
        status = "draining" if health.is_draining else "ready" if health.is_ready else "starting"
        extra: dict[str, object] = {}
        if stopped:
            status, extra = "failed", {"stopped": stopped}
        body = json.dumps({"status": status, **extra, **health.endpoints}).encode() + b"\n"
        code = 200 if status == "ready" else 503
        return web.Response(status=code, body=body, content_type="application/json")

    async def _drain(self, request: web.Request) -> web.Response:
        """An admin route, as every mutating route is."""
        refusal = self._admin.refusal(request.headers.get("Authorization", ""))
        if refusal is not None:
            log.info("refused %s %s: %s", request.method, request.path, refusal)
            return web.Response(status=403, text=f"forbidden: {refusal}\n")
        self._on_drain()
        return web.Response(status=202, text="draining\n")


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log less one thing: a malformed request is the client's problem, a
    DEBUG line rather than an ERROR with a traceback (a port scan would fill the log)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"))

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.debug(f"{msg}: %r", *args, exc_info)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kw)
