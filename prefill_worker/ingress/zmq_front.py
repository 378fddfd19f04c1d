"""The router-facing ZMQ edge: a ROUTER socket and its I/O thread ↔ the engine's inbox queue.

This module owns the socket and its life cycle: the context, the ROUTER options, CURVE, the
connection monitor, the I/O thread and its poll loop, and the outbox the engine fills. What a
message means and where a reply goes is ``dispatch.IngressDispatch``'s (the wire and its
guarantees: docs/protocol.md, part 1). The I/O thread owns the socket and everything below::

    routers ─▶ ROUTER ─▶ dispatch ─▶ (reject now) | inbox.put(PrefillRequest | AbortRequest)
                  ▲  └─ monitor: DISCONNECTED ─▶ AbortRequest(ROUTER_GONE) for its requests
                  │                                                      │ engine loop
                  └── dispatch.reply ◀── outbox (deque) + wake pipe ◀── send_outcome(outcome)

Fairness: one turn reads a bounded batch (``dispatch.receive_batch``), then sends every reply
that is ready. A reply a router cannot take any more (EHOSTUNREACH under ROUTER_MANDATORY) is
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
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.auth
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator

from prefill_worker.curve import CurveServerKeys, start_server
from prefill_worker.inbox import EngineMessage
from prefill_worker.ingress.dispatch import IngressDispatch, IngressObserver, NullIngressObserver
from prefill_worker.ingress.replies import RouterSender
from prefill_worker.ingress.routes import RouteTable
from prefill_worker.ingress.validate import Limits
from prefill_worker.load import LoadSource
from prefill_worker.request import Outcome

log = logging.getLogger(__name__)

_MESSAGE_OVERHEAD_BYTES = 64 * 1024  # a prefill's fields besides token_ids, with room to spare
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_IDLE_POLL_MS = 100
_RETRY_POLL_MS = 1


@dataclass(frozen=True, slots=True)
class IngressStats:
    num_admitted: int
    num_rejected: int
    num_malformed: int
    num_unroutable: int  # replies dropped: the router had gone
    num_orphan_outcomes: int  # outcomes for no request in flight (an engine bug)
    num_inflight: int
    num_sent: int = 0  # results, rejects and pongs handed to ZMQ
    num_routers_gone: int = 0  # router connections that closed with requests in flight
    num_aborted_router_gone: int = 0  # requests aborted because their router went away
    num_from_gone: int = 0  # messages read after their connection had closed (dropped)
    num_no_metadata: int = 0  # messages from peers without metadata, ZMTP/1.0 (dropped)


def default_max_message_bytes(max_prompt_tokens: int) -> int:
    """The largest valid ``prefill`` is its packed token ids plus a few small fields."""
    return 4 * max_prompt_tokens + _MESSAGE_OVERHEAD_BYTES


class IngressError(RuntimeError):
    """The ingress socket could not be set up (bind failure, bad keys)."""


class Ingress:
    """A ZMQ ROUTER at ``bind`` whose own I/O thread validates, admits and answers."""

    def __init__(
        self,
        bind: str,
        inbox: queue.Queue[EngineMessage],
        load: LoadSource,
        *,
        vocab_size: int,
        max_prompt_tokens: int,
        max_pool_tokens: int,
        max_inflight: int,
        max_message_bytes: int | None = None,
        heartbeat_interval_s: float = 5.0,
        heartbeat_timeout_s: float = 15.0,
        curve: CurveServerKeys | None = None,
        observer: IngressObserver | None = None,
        on_drain: Callable[[], None] | None = None,
        allow_drain_message: bool = False,
        ttft_slo_s: float | None = None,
    ) -> None:
        """``max_message_bytes`` None: ``default_max_message_bytes(max_prompt_tokens)``. The
        ``drain`` message calls ``on_drain`` only with ``allow_drain_message``; otherwise it
        is refused with ``forbidden`` (any router could stop the worker)."""
        if max_message_bytes is None:
            max_message_bytes = default_max_message_bytes(max_prompt_tokens)
        self._bind = bind[:-2] + ":*" if bind.endswith(":0") else bind
        self._sockopts = {
            zmq.ROUTER_MANDATORY: 1,
            # Off: while a connection holds a routing id, another connection naming the same
            # id is refused, so it can neither take the replies nor abort the requests.
            zmq.ROUTER_HANDOVER: 0,
            zmq.MAXMSGSIZE: max_message_bytes,
            zmq.HEARTBEAT_IVL: int(heartbeat_interval_s * 1000),
            zmq.HEARTBEAT_TIMEOUT: int(heartbeat_timeout_s * 1000),
            zmq.HEARTBEAT_TTL: int(heartbeat_timeout_s * 1000),
            zmq.SNDHWM: 100_000,
            zmq.RCVHWM: 100_000,
            zmq.LINGER: 500,
        }
        self._curve = curve
        self._stopping = False
        self._outbox: collections.deque[Outcome] = collections.deque()
        self._outbox_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._endpoint: str | None = None
        self._is_closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._sock = self._make_socket()
        # Before bind, so that no connection is accepted unseen.
        self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        observer = observer or NullIngressObserver()
        self._sender = RouterSender(self._sock, observer.on_unroutable)
        self._dispatch = IngressDispatch(
            self._sock,
            self._monitor,
            self._sender,
            inbox,
            load,
            Limits(vocab_size, max_prompt_tokens, max_pool_tokens, ttft_slo_s),
            RouteTable(max_inflight),
            observer=observer,
            on_drain=on_drain,
            allow_drain_message=allow_drain_message,
        )
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
        self._dispatch.is_draining = draining

    @property
    def is_draining(self) -> bool:
        return self._dispatch.is_draining

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> IngressStats:
        c = self._dispatch.counts
        return IngressStats(
            num_admitted=c["admitted"],
            num_rejected=c["rejected"],
            num_malformed=c["malformed"],
            num_unroutable=self._sender.num_unroutable,
            num_orphan_outcomes=c["orphan"],
            num_inflight=self._dispatch.num_inflight,
            num_sent=self._sender.num_sent,
            num_routers_gone=c["routers_gone"],
            num_aborted_router_gone=c["aborted_router_gone"],
            num_from_gone=c["from_gone"],
            num_no_metadata=c["no_metadata"],
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
        self._auth = start_server(self._ctx, self._sock, curve)

    def _teardown(self) -> None:
        if self._sock.closed:
            return
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping:
                retry = self._sender.has_parked
                for ready, _ in poller.poll(_RETRY_POLL_MS if retry else _IDLE_POLL_MS):
                    if ready is self._sock:
                        self._dispatch.receive_batch()
                    elif ready is self._monitor:
                        self._dispatch.read_monitor()
                    else:
                        self._drain_wake_pipe()
                # The pipe is read before the deque is taken, so that no wake-up is lost.
                if self._outbox or self._sender.has_parked:
                    self._send_outbox()
            self._send_outbox()
        except Exception as exc:
            log.exception("ingress I/O thread failed")
            self.error = exc
        finally:
            self._teardown()

    def _drain_wake_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                continue

    def _send_outbox(self) -> None:
        self._sender.retry_parked()
        with self._outbox_lock:
            outcomes, self._outbox = self._outbox, collections.deque()
        for outcome in outcomes:
            self._dispatch.reply(outcome)
