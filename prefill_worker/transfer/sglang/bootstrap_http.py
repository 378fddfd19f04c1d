"""SGLang's bootstrap HTTP routes (``GET /route``, ``GET /health``) on their own thread: how
decodes find this worker. What each answers, and when, is tabled in docs/sglang.md ("What the
worker speaks"): the server info (``accept.server_info``) for rank -1, the control socket's
address for each attention-TP rank of the worker (every one the leader's: ``lead``), a 404
for any other rank, a 400 for a bad parameter, a 405 for ``PUT``;
``/health`` 503 once the engine has not turned for ``stale_s``. Both routes answer 503 while
``is_open()`` says no (the rejoin window, ``backend``). It reads nothing but the answers it
was built with and the health callback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web

from prefill_worker.aio_site import ThreadedSite

log = logging.getLogger(__name__)

_RANK_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class BootstrapHttp:
    """Serves the routes on ``host:port`` (port 0 picks one: ``port`` after ``start``)."""

    def __init__(
        self,
        bind: str,
        server_info: dict[str, object],
        rank_info: dict[str, object],
        is_healthy: Callable[[], bool],
        is_open: Callable[[], bool] = lambda: True,
    ) -> None:
        host, _, port = bind.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._server_info = json.dumps(server_info)
        self._rank_info = json.dumps(rank_info)
        self._num_ranks = 1
        self._dp_ranks: list[str] = [self._rank_info]  # each attention-DP rank's rank_info
        self._query_rooms: Callable[[list[int]], dict[str, int]] = lambda rooms: {}
        self._is_healthy = is_healthy
        self._is_open = is_open
        self._site = ThreadedSite("sglang-http")
        self.port = 0

    @property
    def address(self) -> str:
        """``host:port`` as decodes and routers name it (``--prefill URL PORT``)."""
        return f"{self._host}:{self.port}"

    def start(self) -> None:
        """Bind and serve on a daemon thread; raises OSError here when the bind fails."""
        self.port = self._site.start(self._app(), self._host, self._port)

    def stop(self) -> None:
        self._site.stop()

    def lead(self, server_info: dict[str, object], num_ranks: int) -> None:
        """Answer for a TP group: ``server_info`` names its size, and each of its
        ``num_ranks`` ranks is this control socket. Called before the worker is ready (a
        decode asking earlier, outside any router, could see TP 1)."""
        self._server_info, self._num_ranks = json.dumps(server_info), num_ranks

    def lead_dp(
        self,
        server_info: dict[str, object],
        rank_infos: list[dict[str, object]],
        query_rooms: Callable[[list[int]], dict[str, int]],
    ) -> None:
        """Answer for an attention-DP worker (docs/parallelism.md): ``server_info`` names its
        ``dp_size``, ``rank_infos[r]`` is rank r's control socket (``prefill_port_table``'s
        entry for dp group r), and ``/query_dp_ranks`` asks ``query_rooms``."""
        self._server_info = json.dumps(server_info)
        self._dp_ranks = [json.dumps(info) for info in rank_infos]
        self._query_rooms = query_rooms

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/route", self._route)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)
        return app

    async def _route(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.Response(status=405, text="this worker is its only prefill rank\n")
        try:
            ranks = [int(request.query[key]) for key in _RANK_KEYS]
        except (KeyError, ValueError):
            return web.Response(status=400, text="Missing inputs for bootstrap server.\n")
        if not self._is_open():
            return web.Response(status=503, text="prefill worker starting: not open yet\n")
        if ranks == [-1] * 4:
            return _json(self._server_info)
        dp, cp, tp, pp = ranks
        if 0 <= dp < len(self._dp_ranks) and cp == pp == 0 and 0 <= tp < self._num_ranks:
            return _json(self._dp_ranks[dp])
        why = (
            f"no prefill rank {ranks}: this worker has attention-TP ranks 0..{self._num_ranks - 1}"
        )
        return web.Response(status=404, text=why + "\n")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        """SGLang's ``POST /query_dp_ranks``: each known room (of ``bootstrap_rooms``) to the
        attention-DP rank it was placed on; unknown rooms are left out."""
        try:
            body = await request.json()
            rooms = [int(room) for room in body["bootstrap_rooms"]]
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400, text="bootstrap_rooms: a list of integers\n")
        return _json(json.dumps(self._query_rooms(rooms)))

    async def _health(self, request: web.Request) -> web.Response:
        if not self._is_open():
            return web.Response(status=503, text="prefill worker starting: not open yet\n")
        if self._is_healthy():
            return web.Response(text="OK")
        return web.Response(status=503, text="engine loop stalled\n")


def _json(body: str) -> web.Response:
    return web.Response(text=body, content_type="application/json")
