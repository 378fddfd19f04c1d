"""The DP leader's end of the rank links: requests out to the ranks, outcomes and loads back.

One ZMQ ROUTER on ``ipc://DIR/ranks`` (DIR made mode 0700 by the leader: only the worker's
user reaches it); rank r's DEALER connects with routing id ``r``. One I/O thread owns the
socket; callers on any thread queue frames (a deque and a wake pipe) and return at once. The
relay keeps which rank holds each request in flight, so a router's abort goes where its
request went, a drain waits for every rank's requests, and a failed group answers each of
them once (``fail_inflight``). Outcomes go to ``on_outcome`` on the I/O thread. Frames for a
rank that has not yet said it serves wait for its ``ready`` (a router may send before rank 0
is ready, while a rank still loads).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from prefill_worker.dp import wire
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import AbortRequest, FinishReason, Outcome, PrefillRequest

log = logging.getLogger(__name__)
_POLL_MS = 100


@dataclass(frozen=True, slots=True)
class Placed:
    dp_rank: int
    num_prompt_tokens: int


class Relay:
    def __init__(self, link_dir: str, dp_size: int, on_outcome: Callable[[Outcome], None]) -> None:
        self.endpoint = f"ipc://{link_dir}/ranks"
        self.dp_size = dp_size
        self._on_outcome = on_outcome
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frame for a gone rank raises
        self._sock.bind(self.endpoint)
        self._lock = threading.Lock()
        self._inflight: dict[str, Placed] = {}
        self._outbox: deque[tuple[int, bytes]] = deque()
        # Frames for a rank that has not said it serves (its link may not be connected yet:
        # a router may send before rank 0 is ready), sent once it has.
        self._held: dict[int, list[bytes]] = {r: [] for r in range(1, dp_size)}
        self.loads: dict[int, LoadSnapshot] = {}
        self.endpoints: dict[int, dict[str, object]] = {}
        self._ready = threading.Condition(self._lock)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dp-relay", daemon=True)
        self._thread.start()

    # ---- callers (any thread) ----------------------------------------------------------

    def submit(self, dp_rank: int, request: PrefillRequest) -> None:
        with self._lock:
            self._inflight[request.request_id] = Placed(dp_rank, len(request.token_ids))
        self._send(dp_rank, wire.Submit(request))

    def cancel(self, abort: AbortRequest) -> bool:
        """Forward a router's abort to the rank holding its request; False: no rank does."""
        with self._lock:
            placed = self._inflight.get(abort.request_id)
        if placed is None:
            return False
        self._send(placed.dp_rank, wire.Cancel(abort))
        return True

    def stop_ranks(self) -> None:
        """Each rank drains and exits 0 (the leader's drain is over: nothing is in flight)."""
        for dp_rank in range(1, self.dp_size):
            self._send(dp_rank, wire.Stop())

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def inflight_on(self, dp_rank: int) -> int:
        with self._lock:
            return sum(1 for p in self._inflight.values() if p.dp_rank == dp_rank)

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every rank said it serves within ``timeout_s``."""
        with self._ready:
            return self._ready.wait_for(lambda: len(self.endpoints) == self.dp_size - 1, timeout_s)

    def fail_inflight(self, reason: FinishReason, error: str) -> None:
        """Answer every request a rank still holds (its rank is gone or is being stopped)."""
        with self._lock:
            taken, self._inflight = self._inflight, {}
        for request_id, placed in taken.items():
            self._on_outcome(
                Outcome(request_id, reason.status, reason, placed.num_prompt_tokens, error=error)
            )

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"\0")
        self._thread.join(5.0)
        self._sock.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _send(self, dp_rank: int, message: wire.ToRank) -> None:
        self._outbox.append((dp_rank, wire.encode(message)))
        os.write(self._wake_w, b"\0")

    # ---- the I/O thread ----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._closed:
            poller.poll(_POLL_MS)
            self._receive()
            with contextlib.suppress(BlockingIOError):  # nothing queued since the last turn
                os.read(self._wake_r, 4096)
            while self._outbox:
                dp_rank, frame = self._outbox.popleft()
                if dp_rank in self.endpoints:
                    self._deliver(dp_rank, frame)
                else:
                    self._held[dp_rank].append(frame)

    def _deliver(self, dp_rank: int, frame: bytes) -> None:
        try:
            self._sock.send_multipart([str(dp_rank).encode(), frame])
        except zmq.ZMQError as exc:  # its link is gone: the watch fails the worker
            log.warning("dp rank %d: a frame was not delivered: %s", dp_rank, exc)

    def _receive(self) -> None:
        while True:
            try:
                identity, frame = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(int(identity), wire.decode_to_leader(frame))

    def _handle(self, dp_rank: int, message: wire.ToLeader) -> None:
        if isinstance(message, wire.Done):
            with self._lock:
                placed = self._inflight.pop(message.outcome.request_id, None)
            if placed is not None:  # else failed already (fail_inflight): answered once
                self._on_outcome(message.outcome)
        elif isinstance(message, wire.Load):
            self.loads[dp_rank] = message.load
        else:
            with self._ready:
                self.endpoints[dp_rank] = message.endpoints
                self._ready.notify_all()
            for frame in self._held.pop(dp_rank, []):
                self._deliver(dp_rank, frame)
            log.info("dp rank %d serving: %s", dp_rank, message.endpoints)
