"""The router-facing ZMQ edge: a ROUTER socket and its I/O thread ↔ the engine's inbox queue.

Routers connect DEALER sockets (DESIGN §4, docs/protocol.md). The I/O thread owns the socket
and everything below; the engine loop owns everything else::

    routers ─▶ ROUTER ─▶ decode_router ─▶ (reject now) | inbox.put(PrefillRequest | AbortRequest)
                  ▲                                                      │ engine loop
                  └── encode_outcome ◀── outbox (deque) + wake pipe ◀── send_outcome(outcome)

Invariants: every ``prefill`` gets exactly one ``result`` or ``reject``; a ``request_id`` is in
flight from its admission until its reply has been sent, and a second ``prefill`` with it in
that window is rejected; ``abort`` is forwarded only for an id in flight and never answered.
A reply the router cannot take any more (it went away: EHOSTUNREACH under ROUTER_MANDATORY) is
counted and dropped. Nothing here touches engine state; ``load`` and the observer are called
from the I/O thread and must be thread-safe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from prefill_worker.protocol import (
    Limits,
    LoadSnapshot,
    PingMsg,
    Reject,
    RejectCode,
    decode_router,
    encode_outcome,
    encode_pong,
    encode_reject,
)
from prefill_worker.request import AbortRequest, Outcome, PrefillRequest

log = logging.getLogger(__name__)

_RECV_BATCH = 512  # messages taken per wake-up before the outbox gets a turn
_IDLE_POLL_MS = 100
_RETRY_POLL_MS = 1
_MAX_PARKED = 100_000  # replies parked on full peer pipes before we drop (and count) them

EngineInbox = queue.Queue[PrefillRequest | AbortRequest]


class IngressObserver(Protocol):
    """Counters the metrics implement; called from the I/O thread."""

    def on_request(self) -> None:
        """A ``prefill`` was admitted and handed to the engine."""

    def on_reject(self, code: str) -> None:
        """A ``reject`` with this code was sent (``malformed`` included)."""

    def on_malformed(self) -> None:
        """A frame could not be read at all (not a one-frame msgpack map)."""


class NullIngressObserver:
    def on_request(self) -> None:
        return None

    def on_reject(self, code: str) -> None:
        return None

    def on_malformed(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """CurveZMQ for the ingress socket: the server's key pair and the allowed client keys."""

    public_key: bytes
    secret_key: bytes
    authorized_keys_dir: str

    @classmethod
    def from_files(cls, secret_key_file: str, authorized_keys_dir: str) -> CurveServerKeys:
        """Read a ``zmq.auth`` secret certificate and name the directory of public ones."""
        public, secret = zmq.auth.load_certificate(secret_key_file)
        if secret is None:
            raise ValueError(f"{secret_key_file}: has no secret key (a .key_secret file?)")
        if not os.path.isdir(authorized_keys_dir):
            raise ValueError(f"{authorized_keys_dir}: not a directory of client public keys")
        return cls(public, secret, authorized_keys_dir)


@dataclass(frozen=True, slots=True)
class IngressStats:
    num_admitted: int
    num_rejected: int
    num_malformed: int
    num_unroutable: int  # replies dropped: the router had gone
    num_orphan_outcomes: int  # outcomes for no request in flight (an engine bug)
    num_inflight: int


class IngressError(RuntimeError):
    """The ingress socket could not be set up (bind failure, bad keys)."""


class Ingress:
    """A ZMQ ROUTER at ``bind`` whose own I/O thread validates, admits and answers."""

    def __init__(
        self,
        bind: str,
        inbox: EngineInbox,
        load: Callable[[], LoadSnapshot],
        *,
        vocab_size: int,
        max_prompt_tokens: int,
        max_pool_tokens: int,
        max_inflight: int,
        max_message_bytes: int = 16 * 1024 * 1024,
        heartbeat_interval_s: float = 5.0,
        heartbeat_timeout_s: float = 15.0,
        curve: CurveServerKeys | None = None,
        observer: IngressObserver | None = None,
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        self._bind = bind[:-2] + ":*" if bind.endswith(":0") else bind
        self._inbox = inbox
        self._load = load
        self._limits = Limits(vocab_size, max_prompt_tokens, max_pool_tokens)
        self._max_inflight = max_inflight
        self._sockopts = {
            zmq.ROUTER_MANDATORY: 1,
            zmq.ROUTER_HANDOVER: 1,
            zmq.MAXMSGSIZE: max_message_bytes,
            zmq.HEARTBEAT_IVL: int(heartbeat_interval_s * 1000),
            zmq.HEARTBEAT_TIMEOUT: int(heartbeat_timeout_s * 1000),
            zmq.HEARTBEAT_TTL: int(heartbeat_timeout_s * 1000),
            zmq.SNDHWM: 100_000,
            zmq.RCVHWM: 100_000,
            zmq.LINGER: 500,
        }
        self._curve = curve
        self._observer: IngressObserver = observer or NullIngressObserver()
        self._on_drain = on_drain
        self._draining = False
        self._stopping = False
        self._routes: dict[str, tuple[bytes, bool]] = {}  # request_id -> (identity, logprob?)
        self._outbox: collections.deque[Outcome] = collections.deque()
        self._outbox_lock = threading.Lock()
        # Replies waiting for a router whose pipe was full (SNDHWM), in order, per router.
        self._retry: dict[bytes, collections.deque[bytes]] = {}
        self._num_parked = 0
        self._counts = collections.Counter[str]()
        self._thread: threading.Thread | None = None
        self._endpoint: str | None = None
        self._is_closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._sock = self._make_socket()
        self.error: BaseException | None = None  # set when the I/O thread died

    # ── life cycle (caller's thread) ────────────────────────────────────────────────────────

    def start(self) -> str:
        """Bind, start the I/O thread, and return the bound endpoint (port resolved)."""
        assert self._thread is None, "start() once"
        try:
            if self._curve is not None:
                self._start_curve(self._curve)
            self._sock.bind(self._bind)
        except (zmq.ZMQError, ValueError, OSError) as exc:
            self._teardown()
            raise IngressError(f"cannot bind ingress at {self._bind}: {exc}") from exc
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="ingress-io", daemon=True)
        self._thread.start()
        return self._endpoint

    @property
    def endpoint(self) -> str:
        assert self._endpoint is not None, "start() first"
        return self._endpoint

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what the outbox holds, then stop the I/O thread and close the socket."""
        if self._is_closed:
            return
        self._stopping = True
        if self._thread is None:
            self._teardown()
        else:
            self._wake()
            self._thread.join(timeout_s)
        with self._outbox_lock:
            self._is_closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> Ingress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── engine side (any thread) ────────────────────────────────────────────────────────────

    def send_outcome(self, outcome: Outcome) -> None:
        """Queue the final reply for one request; the I/O thread sends it. Never blocks."""
        with self._outbox_lock:
            if self._is_closed:
                log.warning("ingress is closed; outcome for %r not sent", outcome.request_id)
                return
            self._outbox.append(outcome)
            if len(self._outbox) == 1:
                self._wake()

    def set_draining(self, draining: bool) -> None:
        """While draining, new ``prefill`` messages are rejected with ``draining``."""
        self._draining = draining

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> IngressStats:
        c = self._counts
        return IngressStats(
            num_admitted=c["admitted"],
            num_rejected=c["rejected"],
            num_malformed=c["malformed"],
            num_unroutable=c["unroutable"],
            num_orphan_outcomes=c["orphan"],
            num_inflight=len(self._routes),
        )

    def _wake(self) -> None:
        # BlockingIOError: the pipe already holds wake-ups the I/O thread has not read.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    # ── I/O thread ──────────────────────────────────────────────────────────────────────────

    def _make_socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        for option, value in self._sockopts.items():
            sock.setsockopt(option, value)
        return sock

    def _start_curve(self, curve: CurveServerKeys) -> None:
        # The authenticator answers ZAP for this (private) context only.
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=curve.authorized_keys_dir)
        self._sock.curve_secretkey = curve.secret_key
        self._sock.curve_publickey = curve.public_key
        self._sock.curve_server = True

    def _teardown(self) -> None:
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping:
                for ready, _ in poller.poll(_RETRY_POLL_MS if self._retry else _IDLE_POLL_MS):
                    if ready is self._sock:
                        self._receive_batch()
                    else:
                        self._drain_wake_pipe()
                # The pipe is read before the deque is taken, so that no wake-up is lost.
                if self._outbox or self._retry:
                    self._send_outbox()
            self._send_outbox()
        except Exception as exc:
            log.exception("ingress I/O thread failed")
            self.error = exc
        finally:
            self._teardown()

    def _receive_batch(self) -> None:
        recv = self._sock.recv_multipart
        handle = self._handle
        for _ in range(_RECV_BATCH):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._counts["malformed"] += 1
            self._observer.on_malformed()
            self._reject(identity, Reject(RejectCode.MALFORMED, "expected exactly one frame"))
            return
        msg = decode_router(frames[1], self._limits, time.monotonic())
        if isinstance(msg, PrefillRequest):
            self._admit(identity, msg)
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self._routes:
                self._forward_abort(msg)
        elif isinstance(msg, Reject):
            if msg.code is RejectCode.MALFORMED:
                self._counts["malformed"] += 1
                self._observer.on_malformed()
            self._reject(identity, msg)
        elif isinstance(msg, PingMsg):
            self._pong(identity, msg.nonce)
        else:
            self._draining = True
            if self._on_drain is not None:
                self._on_drain()
            self._pong(identity, msg.nonce)

    def _admit(self, identity: bytes, req: PrefillRequest) -> None:
        reject = self._admission_problem(req)
        if reject is None:
            self._routes[req.request_id] = (identity, req.return_logprob)
            try:
                self._inbox.put_nowait(req)
            except queue.Full:
                del self._routes[req.request_id]
                reject = Reject(RejectCode.OVERLOADED, "the engine queue is full", req.request_id)
            else:
                self._counts["admitted"] += 1
                self._observer.on_request()
                return
        self._reject(identity, reject)

    def _admission_problem(self, req: PrefillRequest) -> Reject | None:
        rid = req.request_id
        if self._draining:
            return Reject(RejectCode.DRAINING, "the worker is draining; send it elsewhere", rid)
        if rid in self._routes:
            why = f"request_id {rid!r} is already in flight"
            return Reject(RejectCode.DUPLICATE_REQUEST_ID, why, rid, "request_id")
        if len(self._routes) >= self._max_inflight:
            why = f"{self._max_inflight} requests already in flight"
            return Reject(RejectCode.OVERLOADED, why, rid)
        return None

    def _forward_abort(self, msg: AbortRequest) -> None:
        try:
            self._inbox.put_nowait(msg)
        except queue.Full:
            log.warning("engine queue full; abort of %r dropped", msg.request_id)

    def _reject(self, identity: bytes, reject: Reject) -> None:
        self._counts["rejected"] += 1
        self._observer.on_reject(reject.code.value)
        self._send(identity, encode_reject(reject))

    def _pong(self, identity: bytes, nonce: int | None) -> None:
        load = self._load()
        if self._draining and not load.draining:
            load = LoadSnapshot(load.waiting, load.running, load.free_kv_pages, True)
        self._send(identity, encode_pong(load, nonce))

    def _drain_wake_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                continue

    def _send_outbox(self) -> None:
        for identity in list(self._retry):
            parked = self._retry[identity]
            while parked and self._try_send(identity, parked[0]):
                parked.popleft()
                self._num_parked -= 1
            if not parked:
                del self._retry[identity]
        with self._outbox_lock:
            outcomes, self._outbox = self._outbox, collections.deque()
        for outcome in outcomes:
            route = self._routes.pop(outcome.request_id, None)
            if route is None:
                self._counts["orphan"] += 1
                log.warning("outcome for %r, which is not in flight", outcome.request_id)
                continue
            self._send(route[0], encode_outcome(outcome, route[1]))

    def _send(self, identity: bytes, frame: bytes) -> None:
        """Send now, or park behind this router's earlier replies while its pipe is full."""
        parked = self._retry.get(identity)
        if parked is None and self._try_send(identity, frame):
            return
        if self._num_parked >= _MAX_PARKED:
            self._counts["unroutable"] += 1
            return
        if parked is None:
            parked = self._retry[identity] = collections.deque()
        parked.append(frame)
        self._num_parked += 1

    def _try_send(self, identity: bytes, frame: bytes) -> bool:
        """False when the peer's pipe is full (try again later); unreachable peers are dropped."""
        try:
            self._sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._counts["unroutable"] += 1
            return True
        self._sock.send(frame, zmq.NOBLOCK)
        return True
