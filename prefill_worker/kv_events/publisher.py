"""The KV-event publisher: the prefix cache's ``CacheEventSink`` on a ZMQ PUB socket.

Threads::

    engine     blocks_stored / blocks_removed / all_cleared: make the event (one per announced
               KV-cache group), queue it, return (never blocks; a full queue drops the event
               and counts it)
    kv-events  every ``batch_interval_s``: the queued events become one KVEventBatch (vLLM's
               wire, ``wire.py``), sent on PUB as [topic, seq, payload] and kept for replay;
               replay requests on the ROUTER socket are answered in between (``replay.py``)

What a subscriber may rely on is in docs/kv-events.md ("Delivery and failure", "Restarts"):
sequence numbers from the run's start time in microseconds (``first_seq_now``), with no
holes; a failed send still held for replay; ``AllBlocksCleared`` after a dropped event, as the
run's first batch and at the head of every batch until its first ``BlockStored``; a batch at
least every ``idle_interval_s``. PUB and ROUTER sends never block.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Literal, Protocol

import zmq

from prefill_worker.kv_events.replay import ReplayBuffer, ReplayOutcome, answer
from prefill_worker.kv_events.wire import (
    DENSE,
    AllBlocksCleared,
    BlockStored,
    EventGroup,
    KVEvent,
    block_removed,
    block_stored,
    encode_batch,
    seq_frame,
)
from prefill_worker.zmq_parts import recv_parts

log = logging.getLogger("prefill_worker.kv_events")

DropReason = Literal["queue_full", "closed", "bad_event", "send_failed"]
_MAX_BATCH_EVENTS = 1024  # a long prompt's stored event is ~its token ids: keep batches small
_MAX_REPLAYS_PER_TURN = 16  # replay is served between batches, never starving them
_REPLAY_PARTS = 3  # [routing id, b"", 8-byte seq]: more parts are read and dropped
_MAX_REPLAY_PART_BYTES = 1024  # a request's parts are tiny; ZMQ drops a larger one unread


def first_seq_now() -> int:
    """A new run's first sequence number: the time in microseconds since the Unix epoch
    (about 2**50.6 in 2026: far inside u64, and below 2**53 for JSON readers until 2255)."""
    return time.time_ns() // 1000


class KVEventsError(RuntimeError):
    """A socket could not be bound; the text names the address."""


class KVEventsObserver(Protocol):
    """Counters for the publisher; called on the engine thread and the publisher thread."""

    def on_published(self, num_events: int) -> None: ...

    def on_dropped(self, reason: DropReason, num_events: int) -> None: ...

    def on_replay(self, outcome: ReplayOutcome) -> None: ...


class NullKVEventsObserver:
    def on_published(self, num_events: int) -> None:
        return None

    def on_dropped(self, reason: DropReason, num_events: int) -> None:
        return None

    def on_replay(self, outcome: ReplayOutcome) -> None:
        return None


class KVEventPublisher:
    """Implements ``kv.cache_events.CacheEventSink``; ``start()`` binds, ``close()`` flushes.
    ``first_seq`` is the sequence number of the run's first batch. ``groups``: the model's
    full-attention KV-cache groups, each of which a cached page's block is announced in (vLLM
    publishes a block once per group holding it; the cache's pages hold every layer)."""

    def __init__(
        self,
        publish_bind: str,
        replay_bind: str | None,
        *,
        topic: str = "",
        max_queued_events: int = 100_000,
        num_replay_batches: int = 10_000,
        batch_interval_s: float = 0.01,
        idle_interval_s: float = 1.0,
        first_seq: int | None = None,
        observer: KVEventsObserver | None = None,
        groups: Sequence[EventGroup] = DENSE,
    ) -> None:
        """``first_seq``: None takes ``first_seq_now()``."""
        if not groups:
            raise ValueError("kv events announce at least one KV-cache group")
        self._groups = tuple(groups)
        self._binds = (publish_bind, replay_bind)
        self._topic = topic.encode()
        self._max_queued_events = max_queued_events
        self._replay_buffer = ReplayBuffer(num_replay_batches)
        self._batch_interval_s = batch_interval_s
        self._observer = observer or NullKVEventsObserver()
        self._queue: collections.deque[KVEvent] = collections.deque()
        self._num_overflows = 0  # engine thread writes
        self._num_overflows_cleared = 0  # publisher thread writes
        self._next_seq = first_seq_now() if first_seq is None else first_seq
        self.first_seq = self._next_seq
        self._idle_interval_s = idle_interval_s
        self._next_idle_at = 0.0  # time.monotonic(): an idle publisher's next batch
        self._has_stored = False  # publisher thread
        self._is_accepting = True  # False once closed, or the thread died: events are dropped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_bind is not None else None
        self.endpoint = ""
        self.replay_endpoint: str | None = None

    # ── life cycle (caller's thread) ────────────────────────────────────────────────────────

    def start(self) -> None:
        """Bind both sockets (port 0: any free port, see ``endpoint``) and start publishing."""
        assert self._thread is None, "start() once"
        publish_bind, replay_bind = self._binds
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 500)
        self.endpoint = self._bind(self._pub, publish_bind)
        if self._replay is not None and replay_bind is not None:
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLAY_PART_BYTES)
            self.replay_endpoint = self._bind(self._replay, replay_bind)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued, stop the thread, close the sockets; later events are dropped."""
        if self._stop.is_set():
            return
        self._is_accepting = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("kv-events thread did not stop in %.1f s; leaving it", timeout_s)
                return
        self._close_sockets()

    def _bind(self, sock: zmq.Socket[bytes], bind: str) -> str:
        try:
            sock.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
        except (zmq.ZMQError, ValueError) as exc:
            self._close_sockets()
            raise KVEventsError(f"cannot bind kv-events socket at {bind}: {exc}") from exc
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        if self._ctx.closed:
            return
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    # ── CacheEventSink (engine thread; never blocks) ────────────────────────────────────────

    def blocks_stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        hashes, tokens = list(block_hashes), list(token_ids)
        for group in self._groups:
            self._enqueue(block_stored(hashes, parent_block_hash, tokens, block_size, group))

    def blocks_removed(self, block_hashes: Sequence[int]) -> None:
        hashes = list(block_hashes)
        for group in self._groups:
            self._enqueue(block_removed(hashes, group))

    def all_cleared(self) -> None:
        self._enqueue(AllBlocksCleared())

    def _enqueue(self, event: KVEvent) -> None:
        if not self._is_accepting:
            self._observer.on_dropped("closed", 1)
        elif len(self._queue) >= self._max_queued_events:
            self._num_overflows += 1
            self._observer.on_dropped("queue_full", 1)
        else:
            self._queue.append(event)

    # ── publisher thread ────────────────────────────────────────────────────────────────────

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must not reach the engine: events stop, counted
            log.exception("kv-events publisher stopped; later events are dropped as 'closed'")
            self._is_accepting = False

    def _loop(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        self._publish([])  # the run's first batch: AllBlocksCleared alone
        while True:
            is_stopping = self._stop.is_set()
            self._publish_queued()
            if time.monotonic() >= self._next_idle_at:
                self._publish([])  # a subscriber that reconnected since learns where we are
            if is_stopping:
                return
            if self._replay is None:
                self._stop.wait(self._batch_interval_s)
            elif poller.poll(round(self._batch_interval_s * 1000)):
                self._serve_replays()

    def _publish_queued(self) -> None:
        while self._queue:
            num_events = min(len(self._queue), _MAX_BATCH_EVENTS)
            self._publish([self._queue.popleft() for _ in range(num_events)])
        if self._num_overflows != self._num_overflows_cleared:
            self._num_overflows_cleared = self._num_overflows
            log.warning("kv-events queue was full: events dropped; telling subscribers to clear")
            self._publish([AllBlocksCleared()])

    def _publish(self, events: list[KVEvent]) -> None:
        if not self._has_stored and not (events and isinstance(events[0], AllBlocksCleared)):
            events = [AllBlocksCleared(), *events]  # what a subscriber kept of an earlier run
        self._next_idle_at = time.monotonic() + self._idle_interval_s
        payload, events = self._encode(events)
        if payload is None:
            return
        self._has_stored = self._has_stored or any(isinstance(e, BlockStored) for e in events)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._replay_buffer.append(seq, payload)
        try:
            self._pub.send_multipart([self._topic, seq_frame(seq), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("kv-events batch %d not sent (kept for replay): %s", seq, exc)
            self._observer.on_dropped("send_failed", len(events))
            return
        self._observer.on_published(len(events))

    def _encode(self, events: list[KVEvent]) -> tuple[bytes | None, list[KVEvent]]:
        """The batch's payload; events that cannot be encoded are dropped alone and counted."""
        try:
            return encode_batch(events), events
        except (TypeError, ValueError, OverflowError):
            good = [event for event in events if _can_encode(event)]
            log.warning("kv-events: %d malformed events dropped", len(events) - len(good))
            self._observer.on_dropped("bad_event", len(events) - len(good))
            return (encode_batch(good) if good else None), good

    def _serve_replays(self) -> None:
        assert self._replay is not None
        for _ in range(_MAX_REPLAYS_PER_TURN):
            try:
                request, num_parts = recv_parts(self._replay, _REPLAY_PARTS)
            except zmq.Again:
                return
            if num_parts != _REPLAY_PARTS:
                request = request[:1]  # refused below as bad_request, whatever it held
            reply = answer(request, self._replay_buffer, self._topic)
            try:
                for message in reply.messages:
                    self._replay.send_multipart(message, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the requester's queue is full: it fails alone
                log.warning("kv-events replay answer cut short: %s", exc)
            self._observer.on_replay(reply.outcome)


def _can_encode(event: KVEvent) -> bool:
    try:
        encode_batch([event])
    except (TypeError, ValueError, OverflowError):
        return False
    return True
