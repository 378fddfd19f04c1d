"""Replies out of the ingress's ROUTER socket without ever blocking its I/O thread.

A router whose pipe is full (SNDHWM) gets its replies later, in order: they are parked per
router and retried every turn. A router that has gone (EHOSTUNREACH under ROUTER_MANDATORY)
cannot get them at all: they are dropped and counted, and so are its parked ones. Used by the
I/O thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import zmq

_MAX_PARKED = 100_000  # replies parked on full peer pipes before we drop (and count) them
# Plain ints: pyzmq's enum flags cost ~1 us per operation on this path.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)


class RouterSender:
    def __init__(self, sock: zmq.Socket[bytes], on_unroutable: Callable[[], None]) -> None:
        self._sock = sock
        self._on_unroutable = on_unroutable
        self._parked: dict[bytes, collections.deque[bytes]] = {}
        self._num_parked = 0
        self.num_sent = 0
        self.num_unroutable = 0

    @property
    def has_parked(self) -> bool:
        return bool(self._parked)

    def send(self, identity: bytes, frame: bytes) -> None:
        """Send now, or park behind this router's earlier replies while its pipe is full."""
        parked = self._parked.get(identity)
        if parked is None and self._try_send(identity, frame):
            return
        if self._num_parked >= _MAX_PARKED:
            self._drop()
            return
        if parked is None:
            parked = self._parked[identity] = collections.deque()
        parked.append(frame)
        self._num_parked += 1

    def retry_parked(self) -> None:
        for identity in list(self._parked):
            parked = self._parked[identity]
            while parked and self._try_send(identity, parked[0]):
                parked.popleft()
                self._num_parked -= 1
            if not parked:
                del self._parked[identity]

    def forget(self, identity: bytes) -> None:
        """The router has gone: what is parked for it can never be delivered."""
        parked = self._parked.pop(identity, ())
        self._num_parked -= len(parked)
        for _ in parked:
            self._drop()

    def _try_send(self, identity: bytes, frame: bytes) -> bool:
        """False when the peer's pipe is full (try again later); unreachable peers are dropped."""
        try:
            self._sock.send(identity, _SNDMORE_NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._drop()
            return True
        self._sock.send(frame, _NOBLOCK)
        self.num_sent += 1
        return True

    def _drop(self) -> None:
        self.num_unroutable += 1
        self._on_unroutable()
