"""The ingress's message handling: from a frame read off the ROUTER socket to its reply frame.

A turn reads a bounded batch of messages (``_RECV_BATCH`` messages or ``_RECV_BATCH_BYTES`` of
frames, so that ready replies wait behind little decoding), files each routing id under its
connection (the monitor says which have closed), and turns each decoded frame into exactly one
of: a ``PrefillRequest`` for the engine's inbox (its id scoped by ``routes.RouteTable``), an
abort of the sender's own request, a ``reject``, a ``pong``, or a ``drain``. An outcome from
the engine is routed back to the router that asked, under the router's own id. The socket's
life cycle, the thread and the outbox are ``zmq_front.py``'s; everything here runs on its I/O
thread, except ``is_draining``, which any thread may set.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Callable
from typing import Protocol

import zmq
import zmq.utils.monitor
from msgspec import UNSET, UnsetType

from prefill_worker.inbox import EngineMessage
from prefill_worker.ingress.connections import RouterConnections
from prefill_worker.ingress.messages import (
    Drain,
    Load,
    Ping,
    Pong,
    Reject,
    RejectCode,
    encode,
    encode_outcome,
)
from prefill_worker.ingress.replies import RouterSender
from prefill_worker.ingress.routes import RouteTable, scope
from prefill_worker.ingress.validate import Limits, decode_router
from prefill_worker.load import TTFT_SLO_REJECT, LoadSource, ttft_slo_refusal
from prefill_worker.request import AbortRequest, FinishReason, Outcome, PrefillRequest
from prefill_worker.zmq_parts import peer_property

log = logging.getLogger(__name__)

_RECV_BATCH = 512  # messages taken per wake-up before the outbox gets a turn
_RECV_BATCH_BYTES = 1 << 20  # ... or this many bytes of frames, whichever comes first
# Plain ints: pyzmq's enum flags cost ~1 us per operation, its ``rcvmore`` attribute ~3 us.
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


class IngressObserver(Protocol):
    """Counters the metrics implement; called from the I/O thread."""

    def on_reject(self, code: str) -> None:
        """A ``reject`` with this code was sent (``malformed`` included)."""

    def on_malformed(self) -> None:
        """A frame could not be read at all (not a one-frame msgpack map)."""

    def on_unroutable(self) -> None:
        """A reply was dropped: its router had gone."""


class NullIngressObserver:
    def on_reject(self, code: str) -> None:
        return None

    def on_malformed(self) -> None:
        return None

    def on_unroutable(self) -> None:
        return None


class IngressDispatch:
    """Reads, admits, aborts, rejects and answers for one ingress; owns the ids in flight."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes],
        sender: RouterSender,
        inbox: queue.Queue[EngineMessage],
        load: LoadSource,
        limits: Limits,
        routes: RouteTable,
        *,
        observer: IngressObserver,
        on_drain: Callable[[], None] | None,
        allow_drain_message: bool,
    ) -> None:
        self._sock = sock
        self._monitor = monitor
        self._connections = RouterConnections()
        self._scopes: dict[bytes, str] = {}  # live routing id → its id prefix (routes.scope)
        self._inbox = inbox
        self._load = load
        self._sender = sender
        self._limits = limits
        self._routes = routes
        self._observer = observer
        self._on_drain = on_drain
        self._allow_drain_message = allow_drain_message
        self.is_draining = False
        self.counts = collections.Counter[str]()

    @property
    def num_inflight(self) -> int:
        return len(self._routes)

    def receive_batch(self) -> None:
        """Handle what the socket holds, up to the batch bound.

        Parts are taken one by one as bytes: a zero-copy ``zmq.Frame`` per part costs more
        than copying a small frame, so only a routing id seen first is read as a ``Frame``
        (its connection's fd). Parts past the second are read and dropped as they come (a
        message of a million parts builds no list)."""
        recv = self._sock.recv
        budget = _RECV_BATCH_BYTES
        for _ in range(_RECV_BATCH):
            try:
                identity = recv(_NOBLOCK)
            except zmq.Again:
                return
            prefix = self._scopes.get(identity)
            if prefix is None:
                body_frame = recv(_NOBLOCK, copy=False)
                body = body_frame.bytes
                if not self._is_connected(identity, body_frame):
                    self._discard_more()
                    continue
                prefix = scope(identity)
                self._scopes[identity] = prefix
            else:
                body = recv(_NOBLOCK)
            if self._sock.get(_RCVMORE):
                self._discard_more()
                self._refuse_frames(identity)
            else:
                self._handle(identity, body, prefix)
            budget -= len(body)
            if budget <= 0:
                return  # the outbox gets its turn before more decoding

    def read_monitor(self) -> None:
        """Take the monitor's connection events; abort what a closed connection left."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                gone = self._connections.on_accepted(fd)
            else:
                gone = self._connections.on_disconnected(fd)
            for identity in gone:
                self._on_router_gone(identity)

    def reply(self, outcome: Outcome) -> None:
        """The final reply for one request, to the router that sent it, under its own id."""
        route = self._routes.pop(outcome.request_id)
        if route is None:
            self.counts["orphan"] += 1
            log.warning("outcome for %r, which is not in flight", outcome.request_id)
            return
        frame = encode_outcome(outcome, route.request_id)
        self._sender.send(route.identity, frame)

    def _is_connected(self, identity: bytes, frame: zmq.Frame) -> bool:
        """A routing id seen first: file it under its connection, unless that has closed or
        the peer has no connection metadata (ZMTP/1.0: ``zmq_parts.peer_property``)."""
        fd = peer_property(frame, zmq.SRCFD)
        if not isinstance(fd, int):
            self.counts["no_metadata"] += 1
            self._observer.on_malformed()
            return False
        self.read_monitor()  # every event before this message is known now
        if self._connections.try_add(identity, fd):
            return True
        self.counts["from_gone"] += 1
        return False

    def _discard_more(self) -> None:
        """The rest of a multipart message; its parts have all arrived with the first."""
        while self._sock.get(_RCVMORE):
            self._sock.recv(_NOBLOCK, copy=False)

    def _refuse_frames(self, identity: bytes) -> None:
        self.counts["malformed"] += 1
        self._observer.on_malformed()
        why = "expected exactly one frame"
        self._reject(identity, Reject(code=RejectCode.MALFORMED, message=why))

    def _handle(self, identity: bytes, body: bytes, prefix: str) -> None:
        msg = decode_router(body, self._limits, time.monotonic(), prefix)
        if isinstance(msg, PrefillRequest):
            self._admit(identity, msg, prefix)
        elif isinstance(msg, AbortRequest):
            scoped_id = self._routes.find(identity, msg.request_id)
            if scoped_id is not None:  # only the sender's own ids
                self._forward_abort(AbortRequest(scoped_id))
        elif isinstance(msg, Reject):
            if msg.code is RejectCode.MALFORMED:
                self.counts["malformed"] += 1
                self._observer.on_malformed()
            self._reject(identity, msg)
        elif isinstance(msg, Ping):
            self._pong(identity, msg.nonce)
        else:
            self._drain(identity, msg)

    def _on_router_gone(self, identity: bytes) -> None:
        """Abort what the router left in flight; its parked replies can never be delivered."""
        self._scopes.pop(identity, None)
        self._sender.forget(identity)
        scoped_ids = self._routes.of_router(identity)
        if not scoped_ids:
            return
        self.counts["routers_gone"] += 1
        self.counts["aborted_router_gone"] += len(scoped_ids)
        log.info(
            "router %s disconnected with %d requests in flight: aborting them",
            identity.hex(),
            len(scoped_ids),
        )
        for scoped_id in scoped_ids:
            self._forward_abort(AbortRequest(scoped_id, FinishReason.ROUTER_GONE))

    def _drain(self, identity: bytes, msg: Drain) -> None:
        if not self._allow_drain_message:
            why = "the drain message is disabled (ingress.allow_drain_message); use SIGTERM"
            nonce = UNSET if msg.nonce is None else msg.nonce
            reject = Reject(code=RejectCode.FORBIDDEN, message=why, field="type", nonce=nonce)
            self._reject(identity, reject)
            return
        log.info("drain asked by router %s", identity.hex())
        self.is_draining = True
        if self._on_drain is not None:
            self._on_drain()
        self._pong(identity, msg.nonce)

    def _admit(self, identity: bytes, req: PrefillRequest, prefix: str) -> None:
        """``req`` carries its scoped id already (``prefix`` and the router's own)."""
        scoped_id = req.request_id
        request_id = scoped_id[len(prefix) :]
        if self.is_draining:
            why = "the worker is draining; send it elsewhere"
            reject: Reject | None = Reject(
                code=RejectCode.DRAINING, message=why, request_id=request_id
            )
        else:
            reject = self._routes.problem(scoped_id, request_id)
        if reject is None and self._is_over_slo(identity, req, request_id):
            return
        if reject is None:
            self._routes.add(identity, scoped_id, request_id)
            try:
                self._inbox.put_nowait(req)
            except queue.Full:
                self._routes.pop(scoped_id)
                why = "the engine queue is full"
                reject = Reject(code=RejectCode.OVERLOADED, message=why, request_id=request_id)
            else:
                self.counts["admitted"] += 1
                return
        self._reject(identity, reject)

    def _is_over_slo(self, identity: bytes, req: PrefillRequest, request_id: str) -> bool:
        """Refused ``overloaded`` (counted as ``ttft_slo``): its predicted TTFT exceeds
        ``admission.ttft_slo_s``."""
        if self._limits.ttft_slo_s is None:
            return False
        why = ttft_slo_refusal(self._load().costs, len(req.token_ids), self._limits.ttft_slo_s)
        if why is None:
            return False
        reject = Reject(code=RejectCode.OVERLOADED, message=why, request_id=request_id)
        self._reject(identity, reject, TTFT_SLO_REJECT)
        return True

    def _forward_abort(self, msg: AbortRequest) -> None:
        try:
            self._inbox.put_nowait(msg)
        except queue.Full:
            log.warning("engine queue full; abort of %r dropped", msg.request_id)

    def _reject(self, identity: bytes, reject: Reject, counted_as: str | None = None) -> None:
        """``counted_as``: the rejects counter's ``code`` label, when not the wire code."""
        self.counts["rejected"] += 1
        self._observer.on_reject(counted_as or reject.code.value)
        self._sender.send(identity, encode(reject))

    def _pong(self, identity: bytes, nonce: int | UnsetType | None) -> None:
        """The engine's load as the router reads it; draining is this ingress's own state."""
        snap = self._load()
        costs = snap.costs
        load = Load(
            waiting=snap.num_bootstrapping + snap.num_waiting,
            running=snap.num_prefilling + snap.num_transferring,
            free_kv_pages=snap.num_free_pages,
            draining=self.is_draining,
            queued_tokens=costs.queued_tokens,
            running_tokens=costs.running_tokens,
            prefill_rate_tps=costs.prefill_rate_tps,
            backlog_s=costs.backlog_s,
            handshake_s=costs.handshake_s,
            transfer_s=costs.transfer_s,
            forward_s=costs.forward_s,
            arrival_tps=costs.arrival_tps,
            chunk_size=costs.chunk_size,
            max_batch_tokens=costs.max_batch_tokens,
        )
        pong = Pong(load=load, nonce=UNSET if nonce is None else nonce)
        self._sender.send(identity, encode(pong))
