"""The reference decode peer behind SGLang's HTTP API, as an SGLang decode server is seen by a
PD router (smg): ``POST /generate`` and ``/v1/completions`` take the router's body with its
``bootstrap_host/port/room``, the KV and first token come from that prefill worker, and the
answer is the greedy continuation's text. A test and demo tool, NOT a decode server.

Threads: the HTTP face (aiohttp, its own loop) only reads requests and queues jobs; the peer's
own thread (``serve_http``) owns the ``DecodePeer``: it takes jobs, steps the peer, and hands
each finished generation back to the request waiting for it. On stop, every request gets
a 503: those the peer thread holds as it leaves its loop, then (``PeerHttp.stop``, on the
face's own loop, so none is queued after it) those still queued; so the face's shutdown never
waits on one. ``stream: true`` answers
in server-sent events, as an SGLang decode does (``peer_sse``). Like an SGLang decode, a request
the model cannot take (a token outside the vocabulary, an empty prompt) is a 400, and a KV
transfer that fails is a 500 (which the router retries, with a new room).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from prefill_worker.ingress.http import probes
from prefill_worker.ingress.http.text import TextCodec
from prefill_worker.ingress.validate import Limits, PromptRefused, check_token_ids
from prefill_worker.load import LoadSnapshot
from prefill_worker.testing import peer_sse
from prefill_worker.testing.decode_peer import DecodePeer, Generation

log = logging.getLogger("prefill_worker.testing.decode_peer")
_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_STOPPING = "decode peer stopping"
_SHUTDOWN_S = 5.0  # the face's shutdown: requests still open after it are cut


@dataclass(frozen=True, slots=True)
class _Job:
    room: int
    token_ids: list[int]
    max_new_tokens: int
    source: str  # the prefill worker's bootstrap address
    done: Callable[[Generation], None]  # called on the peer's thread


class _Refused(ValueError):
    pass


class PeerHttp:
    """The HTTP face: parses, queues ``_Job``s for the peer thread, awaits their results."""

    def __init__(
        self,
        bind: str,
        model: probes.ServedModel,
        codec: TextCodec | None,
        limits: Limits,
        stop_token_ids: Sequence[int],
        sources: Callable[[str, int], str | None],
    ) -> None:
        host, _, port = bind.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._model, self._codec, self._limits = model, codec, limits
        self._stop_ids = frozenset(stop_token_ids)
        self._sources = sources  # (bootstrap host, port) -> a receiver's address, or None
        # A Queue, not a SimpleQueue: the peer thread (the main thread, where signal handlers
        # run) waits on it with a timeout, and CPython 3.11's SimpleQueue.get(timeout=...),
        # interrupted by a signal whose handler outlasts that timeout, then waits for the next
        # put with none: the peer's SIGTERM hang. Queue's timed wait recomputes its deadline.
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.num_requests = 0
        self.is_stopping = False  # set on the face's loop as it stops: new jobs get a 503
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    def start(self) -> int:
        threading.Thread(target=self._loop.run_forever, name="peer-http", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result()

    def stop(self) -> None:
        """After ``serve_http`` has returned: refuse what is still queued (503), close the
        listener and the connections; bounded, and never raises for a slow one."""
        self._on_loop(self._refuse_queued(), "refusing the queued requests")
        if self._runner is not None:
            self._on_loop(self._runner.cleanup(), "HTTP shutdown")
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _on_loop(self, step: Coroutine[Any, Any, None], what: str) -> None:
        done = asyncio.run_coroutine_threadsafe(step, self._loop)
        try:
            done.result(_SHUTDOWN_S + 1)
        except TimeoutError:
            log.warning("decode peer: %s took over %.0f s; cut", what, _SHUTDOWN_S + 1)

    async def _refuse_queued(self) -> None:
        """On the face's loop, where ``_run`` checks ``is_stopping`` and queues in one step:
        no job is queued after this."""
        self.is_stopping = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.done(Generation(job.room, False, (), _STOPPING))

    async def _serve(self) -> int:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        model, idle = self._model, LoadSnapshot()
        infos: dict[str, Callable[[], Any]] = {
            "/server_info": lambda: probes.server_info(model),
            "/model_info": lambda: probes.model_info(model),
            "/v1/models": lambda: probes.models(model),
            "/loads": lambda: probes.loads(model, idle),
            "/v1/loads": lambda: probes.loads(model, idle),
            "/health": lambda: {},
        }
        for path, make in infos.items():
            app.router.add_get(path, _json_route(make))
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        return int(self._runner.addresses[0][1])

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, is_completion=False)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, is_completion=True)

    async def _handle(self, request: web.Request, is_completion: bool) -> web.StreamResponse:
        self.num_requests += 1
        started = time.monotonic()
        try:
            body = json.loads(await request.read())
            jobs = self._jobs(body, is_completion)
        except (_Refused, ValueError, TypeError, KeyError) as exc:
            return _error(400, str(exc))
        gens = await asyncio.gather(*(self._run(job) for job in jobs))
        failed = [g for g in gens if not g.is_ok]
        if any(g.error == _STOPPING for g in failed):
            return _error(503, _STOPPING)
        if failed:
            return _error(500, f"KV transfer failed: {failed[0].error}")
        is_stream = bool(body.get("stream"))
        if is_completion:
            if is_stream:
                return await peer_sse.send_events(request, self._completion_events(gens))
            return _json(self._completion(gens))
        items = [
            self._generated(g, len(j.token_ids), started) for g, j in zip(gens, jobs, strict=True)
        ]
        is_batch = isinstance(body.get("bootstrap_room"), list)
        if is_stream:
            events = peer_sse.generate_events(items, self._text, is_batch)
            return await peer_sse.send_events(request, events)
        return _json(items if is_batch else items[0])

    def _jobs(self, body: dict[str, Any], is_completion: bool) -> list[_Job]:
        given = body["prompt"] if is_completion else body.get("input_ids", body.get("text"))
        if not isinstance(given, (str, list)):
            raise _Refused("give input_ids or text")
        is_one = isinstance(given, str) or (given and not isinstance(given[0], (list, str)))
        prompts: list[Any] = [given] if is_one or isinstance(given, str) else given
        rooms = _listed(body["bootstrap_room"], len(prompts))
        hosts = _listed(body["bootstrap_host"], len(prompts))
        ports = _listed(body["bootstrap_port"], len(prompts))
        params = body.get("sampling_params") or {}
        max_new = (
            body.get("max_tokens", 16)
            if is_completion
            else params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        )
        jobs = []
        for prompt, room, host, port in zip(prompts, rooms, hosts, ports, strict=True):
            source = self._sources(host, port)
            if source is None:
                raise _Refused(f"this decode is registered with no prefill at {host}:{port}")
            jobs.append(_Job(room, self._token_ids(prompt), int(max_new), source, _noop))
        return jobs

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self._codec is None:
                raise _Refused("no tokenizer: send input_ids")
            prompt = self._codec.encode(prompt)
        try:
            return list(check_token_ids(prompt, self._limits))
        except PromptRefused as exc:
            raise _Refused(str(exc)) from None

    async def _run(self, job: _Job) -> Generation:
        if self.is_stopping:
            return Generation(job.room, False, (), _STOPPING)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Generation] = loop.create_future()

        def done(gen: Generation) -> None:
            loop.call_soon_threadsafe(future.set_result, gen)

        self.jobs.put(_Job(job.room, job.token_ids, job.max_new_tokens, job.source, done))
        return await future

    def _generated(self, gen: Generation, num_prompt: int, started: float) -> dict[str, Any]:
        tokens = list(gen.token_ids)
        if tokens and tokens[-1] in self._stop_ids:
            finish: dict[str, Any] = {"type": "stop", "matched": tokens[-1]}
        else:
            finish = {"type": "length", "length": len(tokens)}
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": num_prompt,
            "completion_tokens": len(tokens),
            "cached_tokens": gen.num_cached_tokens,
            "e2e_latency": time.monotonic() - started,
            "kv_wait_s": gen.kv_wait_s,
            "decode_s": gen.decode_s,
            "input_token_logprobs": [],  # the prefill's are prepended by the router
        }
        return {"text": self._text(tokens), "output_ids": tokens, "meta_info": meta}

    def _completion(self, gens: Sequence[Generation]) -> dict[str, Any]:
        choices = [
            {"index": i, "text": self._text(list(g.token_ids)), "finish_reason": "length"}
            for i, g in enumerate(gens)
        ]
        name = self._model.served_model_name
        return {"object": "text_completion", "model": name, "choices": choices}

    def _completion_events(self, gens: Sequence[Generation]) -> Any:
        texts = [
            [self._text(list(g.token_ids[:k])) for k in range(1, len(g.token_ids) + 1)]
            for g in gens
        ]
        name = self._model.served_model_name
        return peer_sse.completion_events(texts, name, f"cmpl-{uuid.uuid4().hex}")

    def _text(self, tokens: list[int]) -> str:
        if self._codec is None:
            return ""
        return self._codec.decode([t for t in tokens if t not in self._stop_ids])


def serve_http(peer: DecodePeer, front: PeerHttp, stop: threading.Event) -> None:
    """The peer's thread: take jobs, step, hand each generation back, until ``stop``; then
    the requests it holds get a 503 (``PeerHttp.stop`` refuses those still queued)."""
    waiting: dict[int, Callable[[Generation], None]] = {}
    while not stop.is_set():
        try:  # nothing to compute: wait a little for a job instead of spinning
            job: _Job | None = (
                front.jobs.get_nowait() if peer.is_decoding else front.jobs.get(timeout=0.002)
            )
        except queue.Empty:
            job = None
        while job is not None:
            _take(peer, waiting, job)
            try:
                job = front.jobs.get_nowait()
            except queue.Empty:
                job = None
        for gen in peer.step():
            waiting.pop(gen.room)(gen)
    for room, done in waiting.items():
        done(Generation(room, False, (), _STOPPING))


def _take(peer: DecodePeer, waiting: dict[int, Callable[[Generation], None]], job: _Job) -> None:
    if job.room in waiting:
        job.done(Generation(job.room, False, (), "room already in flight here"))
        return
    waiting[job.room] = job.done
    peer.expect(job.room, job.token_ids, job.max_new_tokens, job.source)
    log.info("request taken: %d in flight", len(waiting))


def _listed(value: Any, n: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise _Refused(f"{len(value)} bootstrap entries for {n} prompts")
        return value
    return [value] * n


def _noop(gen: Generation) -> None:
    return None


def _json_route(make: Callable[[], Any]) -> Callable[[web.Request], Any]:
    async def route(request: web.Request) -> web.Response:
        return _json(make())

    return route


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status)
