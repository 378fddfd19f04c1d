"""The HTTP API front: SGLang's HTTP surface on aiohttp (uvloop underneath), beside the ZMQ
ingress, entering the same engine inbox (docs/http-api.md).

A PD router POSTs each request here and to a decode server at once, with the bootstrap room
the decode will name. A request becomes one ``PrefillRequest`` per prompt (``prompts.py``),
is put in the engine's inbox like a ZMQ ``prefill``, and is answered when its outcome comes
back; the engine guarantees one outcome per request, so no answer waits forever, and a client
that goes away aborts its requests. Threads::

    http-api thread (its own event loop)       engine thread
      POST /generate ─ admit ─▶ inbox.put ──────▶ ... one Outcome per request
                  await future ◀── call_soon_threadsafe ◀── send_outcome(outcome)

Status codes and bodies are ``answers.py``'s, probes ``probes.py``'s; readiness and draining
are set by the daemon (``set_ready``, ``set_draining``). Bodies over ``_INLINE_BYTES`` and texts
are read and tokenized on the front's executor thread, so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from aiohttp import web

from prefill_worker.aio_site import ThreadedSite
from prefill_worker.inbox import EngineMessage
from prefill_worker.ingress.http import answers, probes, pull
from prefill_worker.ingress.http.bodies import BadRequest, Prompt, read_completion, read_generate
from prefill_worker.ingress.http.prompts import Admitter, trace_context_of
from prefill_worker.ingress.http.text import TextCodec
from prefill_worker.ingress.validate import Limits
from prefill_worker.load import TTFT_SLO_REJECT, LoadSource, ttft_slo_refusal
from prefill_worker.request import AbortRequest, Outcome, PrefillRequest
from prefill_worker.transfer.vllm.tickets import Tickets

log = logging.getLogger(__name__)

_Reader = Callable[[bytes, int], tuple[list[Prompt], bool]]
_Admitted = tuple[list[Prompt], bool, list[PrefillRequest]]
_INLINE_BYTES = 64 * 1024  # bodies up to this size are read on the event loop


class HttpApi:
    """Serves SGLang's API on ``host:port`` (port 0 picks one: ``port`` after ``start``)."""

    def __init__(
        self,
        bind: str,
        inbox: queue.Queue[EngineMessage],
        load: LoadSource,
        limits: Limits,
        model: probes.ServedModel,
        codec: TextCodec | None,
        *,
        max_inflight: int,
        max_body_bytes: int,
        is_live: Callable[[], bool] = lambda: True,
        metrics_text: Callable[[], bytes] | None = None,
        on_reject: Callable[[str], None] = lambda code: None,
        tickets: Tickets | None = None,
    ) -> None:
        host, _, port = bind.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._inbox, self._load, self._model, self._codec = inbox, load, model, codec
        self._admitter, self._limits = Admitter(limits, codec), limits
        self._max_inflight, self._max_body_bytes = max_inflight, max_body_bytes
        self._is_live, self._metrics_text, self._on_reject = is_live, metrics_text, on_reject
        self._tickets = tickets  # vLLM pulls (transfer.protocol serving vllm); None: refused
        self._pending: dict[str, asyncio.Future[Outcome]] = {}  # event-loop thread only
        self._released: set[str] = set()  # refused requests whose rooms were withdrawn
        self._site = ThreadedSite("http-api")
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="http-api-admit")
        self._big_bodies = asyncio.Semaphore(1)  # one big body read and parsed at a time
        self.is_ready = False
        self.is_draining = False
        self.port = 0

    # ── life cycle (caller's thread) ────────────────────────────────────────────────────────

    def start(self) -> int:
        """Bind and serve on a daemon thread; returns the port (OSError if the bind fails)."""
        self.port = self._site.start(self._app(), self._host, self._port, handler_cancellation=True)
        return self.port

    def stop(self) -> None:
        """Close the listener; requests in flight get a moment to be answered."""
        self._site.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def set_ready(self, is_ready: bool) -> None:
        self.is_ready = is_ready

    def set_draining(self, is_draining: bool) -> None:
        """While draining, /health and new requests answer 503: the router sends elsewhere."""
        self.is_draining = is_draining

    # ── engine side (any thread) ────────────────────────────────────────────────────────────

    def send_outcome(self, outcome: Outcome) -> None:
        """Hand one request's outcome to the request waiting for it. Never blocks."""
        loop = self._site.loop
        try:
            if loop is None:
                raise RuntimeError("stopped")
            loop.call_soon_threadsafe(self._resolve, outcome)
        except RuntimeError:
            log.warning("HTTP API stopped; outcome for %r not sent", outcome.request_id)

    # ── event-loop thread ───────────────────────────────────────────────────────────────────

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body_bytes)
        for path, handler in self._get_routes().items():
            app.router.add_get(path, handler)
        for path in ("/generate", "/v1/completions"):
            app.router.add_route("POST", path, self._post_handler(path))
        return app

    def _get_routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
        model = self._model
        infos: dict[str, Callable[[], Any]] = {
            "/server_info": lambda: probes.server_info(model),
            "/model_info": lambda: probes.model_info(model),
            "/v1/models": lambda: probes.models(model),
            "/loads": lambda: probes.loads(model, self._load()),
        }
        infos["/v1/loads"] = infos["/get_load"] = infos["/loads"]
        infos["/get_server_info"] = infos["/server_info"]
        infos["/get_model_info"] = infos["/model_info"]
        routes = {path: _json_route(make) for path, make in infos.items()}
        routes["/health"] = routes["/health_generate"] = self._health
        if self._metrics_text is not None:
            routes["/metrics"] = self._metrics
        return routes

    async def _health(self, request: web.Request) -> web.Response:
        why = self._unavailable()
        return web.Response(status=503 if why else 200, text=f"{why or 'ok'}\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self._metrics_text is not None
        body = self._metrics_text()
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    def _unavailable(self) -> str | None:
        if not self.is_ready:
            return "starting"
        if self.is_draining:
            return "draining"
        return None if self._is_live() else "engine loop stalled"

    def _post_handler(self, path: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        if path == "/generate":
            return lambda request: self._handle(request, read_generate, self._generated)
        return lambda request: self._handle(request, _read_completion, self._completed)

    async def _handle(
        self,
        request: web.Request,
        read: _Reader,
        answer: Callable[[Sequence[Outcome], list[answers.Asked], bool], Any],
    ) -> web.Response:
        try:
            prompts, is_batch, requests = await self._prepare(request, read)
            pull.open_pulls(self._tickets, prompts, request.headers.get("X-Request-Id"))
            requests = pull.trim_pulls(self._tickets, prompts, requests)
        except BadRequest as exc:
            return self._refuse(exc.status, str(exc), exc.code)
        try:
            return await self._serve(prompts, is_batch, requests, answer)
        finally:
            pull.close_pulls(self._tickets, prompts)  # a refusal or a client gone: no params

    async def _serve(
        self,
        prompts: list[Prompt],
        is_batch: bool,
        requests: list[PrefillRequest],
        answer: Callable[[Sequence[Outcome], list[answers.Asked], bool], Any],
    ) -> web.Response:
        why = self._unavailable()
        if why is not None:
            self._release(requests)
            return self._refuse(503, f"the worker is {why}; send it elsewhere", "draining")
        if len(self._pending) + len(requests) > self._max_inflight:
            self._release(requests)
            why = f"{len(self._pending)} requests in flight (most {self._max_inflight})"
            return self._refuse(429, why, "overloaded")
        why = self._over_slo(requests)
        if why is not None:
            self._release(requests)
            return self._refuse(429, why, "overloaded", counted_as=TTFT_SLO_REJECT)
        outcomes = await self._submit(requests)
        status = answers.status_of(outcomes)
        if status != 200:
            return _json(answers.failure_body(outcomes), status)
        asked = [_asked(p, r) for p, r in zip(prompts, requests, strict=True)]
        body = answer(outcomes, asked, is_batch)
        pulled = pull.close_pulls(self._tickets, prompts)[0] if prompts[0].is_pull else None
        if pulled is not None:
            body["kv_transfer_params"] = pulled
        return _json(body)

    async def _prepare(self, request: web.Request, read: _Reader) -> _Admitted:
        """The body read, its prompts and their engine requests (``BadRequest`` if not valid).
        Small bodies of ids stay on the event loop; texts and big bodies go to the executor,
        big bodies one at a time (their prompts' ids refer to the body until admitted)."""
        arrival_time = time.monotonic()
        trace = trace_context_of(request.headers)
        size = request.content_length
        if size is not None and size > self._max_body_bytes:
            why = f"a body of {size} bytes; at most {self._max_body_bytes}"
            raise BadRequest(why, "too_large", 413)
        if size is not None and size <= _INLINE_BYTES:
            prompts, is_batch = read(await self._read(request), self._max_inflight)
            if all(p.text is None for p in prompts):
                return prompts, is_batch, self._admitter.admit(prompts, arrival_time, trace)
            requests = await self._off_loop(self._admitter.admit, prompts, arrival_time, trace)
            return prompts, is_batch, requests
        async with self._big_bodies:
            body = await self._read(request)
            prompts, is_batch = await self._off_loop(read, body, self._max_inflight)
            requests = await self._off_loop(self._admitter.admit, prompts, arrival_time, trace)
            return prompts, is_batch, requests

    async def _read(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            why = f"the body is over {self._max_body_bytes} bytes"
            raise BadRequest(why, "too_large", 413) from None

    async def _off_loop(self, work: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(work, *args))

    def _generated(
        self, outcomes: Sequence[Outcome], asked: list[answers.Asked], batch: bool
    ) -> Any:
        return answers.generate_body(outcomes, asked, self._codec, batch)

    def _completed(
        self, outcomes: Sequence[Outcome], asked: list[answers.Asked], batch: bool
    ) -> Any:
        name = self._model.served_model_name
        return answers.completion_body(outcomes, asked, self._codec, name)

    async def _submit(self, requests: list[PrefillRequest]) -> list[Outcome]:
        """Into the engine; the outcomes, in order. A client gone aborts what is left."""
        loop = asyncio.get_running_loop()
        futures = []
        for req in requests:
            future: asyncio.Future[Outcome] = loop.create_future()
            self._pending[req.request_id] = future
            futures.append(future)
            self._inbox.put_nowait(req)
        try:
            await asyncio.wait(futures)  # never cancels the futures themselves
        except asyncio.CancelledError:
            for req, future in zip(requests, futures, strict=True):
                if not future.done():
                    self._inbox.put_nowait(AbortRequest(req.request_id))
            raise
        return [future.result() for future in futures]

    def _release(self, requests: list[PrefillRequest]) -> None:
        """Refused here, so their decodes must not wait out a timeout for them: each room is
        opened and withdrawn at once (the transfer side tells a decode that wants it, or that
        wanted it already, that it failed), and the router's retry goes on without delay. At
        most ``max_inflight`` refused requests are withdrawn at a time: beyond that, as for a
        batch larger than ``max_inflight``, the decodes wait out their own timeouts rather than
        a flood of refusals entering the engine."""
        if len(self._released) + len(requests) > self._max_inflight:
            return
        for req in requests:
            self._released.add(req.request_id)
            self._inbox.put_nowait(req)
            self._inbox.put_nowait(AbortRequest(req.request_id))

    def _resolve(self, outcome: Outcome) -> None:
        if outcome.request_id in self._released:
            self._released.discard(outcome.request_id)
            return
        future = self._pending.pop(outcome.request_id, None)
        if future is None:
            log.warning("outcome for %r, which is not in flight here", outcome.request_id)
        elif not future.done():
            future.set_result(outcome)

    def _over_slo(self, requests: list[PrefillRequest]) -> str | None:
        """Why the batch is refused under ``admission.ttft_slo_s`` (its longest prompt's
        predicted TTFT exceeds it), or None."""
        if self._limits.ttft_slo_s is None or not requests:
            return None
        num_tokens = max(len(r.token_ids) for r in requests)
        return ttft_slo_refusal(self._load().costs, num_tokens, self._limits.ttft_slo_s)

    def _refuse(
        self, status: int, message: str, code: str, counted_as: str | None = None
    ) -> web.Response:
        self._on_reject(counted_as or code)
        return _json(answers.error_body(status, message, code), status)


def _asked(prompt: Prompt, request: PrefillRequest) -> answers.Asked:
    start = request.prompt_logprob_start if request.return_logprob else None
    scored = () if start is None else request.token_ids[start:]
    return answers.Asked(prompt.return_logprob, prompt.rid, prompt.return_text_in_logprobs, scored)


def _read_completion(body: bytes, max_prompts: int) -> tuple[list[Prompt], bool]:
    return read_completion(body, max_prompts), False


def _json_route(make: Callable[[], Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def route(request: web.Request) -> web.Response:
        return _json(make())

    return route


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )
