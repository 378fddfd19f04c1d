"""A DP rank's front: the link to its leader in place of a router-facing ingress.

The rank's daemon hands it what an ingress would be (``Daemon._start_front``): requests the
leader placed here go into the rank's inbox, outcomes go back to the leader, and the rank's
load follows every change (checked each ``_POLL_MS``). ``announce`` sends the rank's
endpoints once it serves; a ``stop`` from the leader calls ``on_stop`` (the rank drains). A
request that arrives while the rank drains is answered ``draining`` at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from prefill_worker.dp import wire
from prefill_worker.inbox import Inbox
from prefill_worker.load import LoadSource
from prefill_worker.request import FinishReason, Outcome

log = logging.getLogger(__name__)
_POLL_MS = 50


class RankFront:
    def __init__(
        self,
        endpoint: str,
        dp_rank: int,
        inbox: Inbox,
        load: LoadSource,
        on_stop: Callable[[], None],
    ) -> None:
        self.endpoint = f"{endpoint} (dp rank {dp_rank})"
        self._inbox, self._load, self._on_stop = inbox, load, on_stop
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, str(dp_rank).encode())
        self._sock.setsockopt(zmq.LINGER, 2000)  # the last outcomes go before close
        self._sock.connect(endpoint)
        self._outbox: deque[bytes] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._is_draining = self._closed = False
        self._sent_load: object = None
        self._thread = threading.Thread(target=self._run, name="dp-front", daemon=True)
        self._thread.start()

    def send_outcome(self, outcome: Outcome) -> None:
        self._queue(wire.Done(outcome))

    def announce(self, endpoints: dict[str, Any]) -> None:
        self._queue(wire.Ready(endpoints))

    def set_draining(self, draining: bool) -> None:
        self._is_draining = draining

    def is_draining(self) -> bool:
        return self._is_draining

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        os.write(self._wake_w, b"\0")
        self._thread.join(timeout_s)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _queue(self, message: wire.ToLeader) -> None:
        self._outbox.append(wire.encode(message))
        os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            poller.poll(_POLL_MS)
            self._receive()
            with contextlib.suppress(BlockingIOError):  # nothing queued since the last turn
                os.read(self._wake_r, 4096)
            self._send_load()
            while self._outbox:
                self._sock.send(self._outbox.popleft())
            if self._closed:
                return

    def _receive(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = wire.decode_to_rank(frame)
            if isinstance(message, wire.Submit):
                self._admit(message)
            elif isinstance(message, wire.Cancel):
                self._inbox.put(message.abort)
            else:
                self._on_stop()

    def _admit(self, message: wire.Submit) -> None:
        request = message.request
        if not self._is_draining:
            self._inbox.put(request)
            return
        reason = FinishReason.DRAINING
        refused = Outcome(request.request_id, reason.status, reason, len(request.token_ids))
        self._outbox.append(wire.encode(wire.Done(refused)))

    def _send_load(self) -> None:
        load = self._load()
        if load != self._sent_load:
            self._sent_load = load
            self._outbox.append(wire.encode(wire.Load(load)))
