"""A router's side of the wire protocol: ``RouterClient`` (asyncio) and a blocking wrapper.

One DEALER socket connected to one worker's ingress. Replies are matched to callers by
``request_id`` (and pings by a nonce), so any number of requests can be in flight at once.
Used by the tests, the benchmarks and the demo; a production router can embed it as is or
re-implement docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio
import zmq.auth

from prefill_worker.curve import CurveClientKeys, apply_client
from prefill_worker.ingress.messages import (
    Abort,
    Drain,
    Load,
    Ping,
    Pong,
    ProtocolError,
    Reject,
    Result,
    WorkerMessage,
    decode_worker,
    encode,
    prefill_message,
)
from prefill_worker.request import SamplingParams

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_GREEDY = SamplingParams()


class RequestRejected(Exception):
    """The worker answered a ``prefill`` with a ``reject``."""

    def __init__(self, reject: Reject) -> None:
        super().__init__(f"{reject.code.value}: {reject.message}")
        self.reject = reject

    @property
    def code(self) -> str:
        return self.reject.code.value


class RouterClient:
    """Asyncio client of one worker; create and use it inside one running event loop."""

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveClientKeys | None = None,
        heartbeat_interval_s: float = 5.0,
        heartbeat_timeout_s: float = 15.0,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        if curve is not None:
            apply_client(self._sock, curve)
        self._sock.connect(endpoint)
        self._results: dict[str, asyncio.Future[Result]] = {}
        self._pongs: dict[int, asyncio.Future[Load]] = {}
        self._nonces = itertools.count(1)
        self._receiver: asyncio.Task[None] | None = None
        self.num_unmatched = 0  # replies no caller waited for (late, or a reject with no id)

    async def prefill(
        self,
        token_ids: Sequence[int],
        bootstrap_room: int,
        *,
        sampling: SamplingParams = _GREEDY,
        return_logprob: bool = False,
        deadline_s: float | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        decode_peer: str | None = None,
        logprob_start_len: int | None = None,
        traceparent: str | None = None,
    ) -> Result:
        """Send one ``prefill`` and wait for its ``result``; a ``reject`` raises
        ``RequestRejected``; ``timeout_s`` bounds the wait (``TimeoutError``). ``decode_peer``
        names the only decode agent that may claim the room. With ``return_logprob``,
        ``logprob_start_len`` asks for prompt logprobs (``unpack_logprobs`` reads them);
        ``traceparent`` makes the worker's request span a child of that W3C span."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        msg = prefill_message(
            rid,
            token_ids,
            bootstrap_room,
            sampling,
            return_logprob,
            deadline_s,
            decode_peer,
            logprob_start_len,
            traceparent,
        )
        frame = encode(msg)
        future: asyncio.Future[Result] = self._expect(self._results, rid)
        return await self._roundtrip(self._results, rid, future, frame, timeout_s)

    async def abort(self, request_id: str) -> None:
        """Ask the worker to drop a request; its ``prefill`` then ends with ``aborted``."""
        await self._sock.send(encode(Abort(request_id=request_id)))

    async def ping(self, timeout_s: float | None = None) -> Load:
        return await self._load_query(Ping, timeout_s)

    async def drain(self, timeout_s: float | None = None) -> Load:
        """Tell the worker to stop admitting; answered with its load (``draining`` set), or
        ``RequestRejected`` (``forbidden``) where the worker does not allow the message."""
        return await self._load_query(Drain, timeout_s)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        pending: list[asyncio.Future[Any]] = [*self._results.values(), *self._pongs.values()]
        for future in pending:
            future.cancel()
        self._sock.close()
        self._ctx.term()

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _load_query(self, kind: type[Ping] | type[Drain], timeout_s: float | None) -> Load:
        nonce = next(self._nonces)
        future = self._expect(self._pongs, nonce)
        return await self._roundtrip(
            self._pongs, nonce, future, encode(kind(nonce=nonce)), timeout_s
        )

    def _expect(self, pending: dict[Any, asyncio.Future[_T]], key: Any) -> asyncio.Future[_T]:
        if key in pending:
            raise ValueError(f"{key!r} is already in flight on this client")
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        pending[key] = future
        return future

    async def _roundtrip(
        self,
        pending: dict[Any, asyncio.Future[_T]],
        key: Any,
        future: asyncio.Future[_T],
        frame: bytes,
        timeout_s: float | None,
    ) -> _T:
        """Send ``frame`` and wait for its answer, both within ``timeout_s``: a DEALER with no
        live peer (a worker that refused our CURVE handshake, or is not up) blocks the send."""
        try:
            return await asyncio.wait_for(self._send_then(frame, future), timeout_s)
        finally:
            if pending.get(key) is future:
                del pending[key]

    async def _send_then(self, frame: bytes, future: asyncio.Future[_T]) -> _T:
        await self._sock.send(frame)
        return await future

    async def _receive(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                self._dispatch(decode_worker(frame))
            except ProtocolError as exc:
                self.num_unmatched += 1
                log.warning("unreadable reply from the worker: %s", exc)

    def _dispatch(self, msg: WorkerMessage) -> None:
        if isinstance(msg, Pong) or (isinstance(msg, Reject) and isinstance(msg.nonce, int)):
            pong = self._pongs.pop(msg.nonce, None) if isinstance(msg.nonce, int) else None
            if pong is not None and not pong.done():
                if isinstance(msg, Reject):
                    pong.set_exception(RequestRejected(msg))
                else:
                    pong.set_result(msg.load)
                return
        elif isinstance(msg.request_id, str):
            future = self._results.pop(msg.request_id, None)
            if future is not None and not future.done():
                if isinstance(msg, Reject):
                    future.set_exception(RequestRejected(msg))
                else:
                    future.set_result(msg)
                return
        self.num_unmatched += 1
        log.debug("reply nobody waits for: %s", msg)


class BlockingRouterClient:
    """``RouterClient`` driven from plain threads: an event loop runs in a helper thread."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-client")
        self._thread.daemon = True
        self._thread.start()
        self._client: RouterClient = self._call(self._make(endpoint, kwargs))

    async def _make(self, endpoint: str, kwargs: dict[str, Any]) -> RouterClient:
        return RouterClient(endpoint, **kwargs)

    def prefill(self, token_ids: Sequence[int], bootstrap_room: int, **kwargs: Any) -> Result:
        """As ``RouterClient.prefill``; ``timeout_s`` (default 30 s) bounds the wait."""
        kwargs.setdefault("timeout_s", 30.0)
        return self._call(self._client.prefill(token_ids, bootstrap_room, **kwargs))

    def abort(self, request_id: str) -> None:
        self._call(self._client.abort(request_id))

    def ping(self, timeout_s: float = 30.0) -> Load:
        return self._call(self._client.ping(timeout_s))

    def drain(self, timeout_s: float = 30.0) -> Load:
        return self._call(self._client.drain(timeout_s))

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _close(self) -> None:
        self._client.close()

    def __enter__(self) -> BlockingRouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
