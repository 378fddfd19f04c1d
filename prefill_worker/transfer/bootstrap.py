"""The worker's bootstrap server: a ZMQ ROUTER that decode peers register, want and abort on.

Polled without blocking from the engine loop (``poll`` drains what has arrived); it only
moves and decodes frames, the NIXL backend decides what they mean. Binds 127.0.0.1 in tests;
``endpoint`` is the address actually bound (port 0 allowed).
"""

from __future__ import annotations

import logging

import zmq

from prefill_worker.transfer import wire

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class BootstrapServer:
    """ROUTER socket: (peer identity, message or WireError) in, messages out."""

    def __init__(self, bind: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer keeps its identity
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise OSError(f"bootstrap server cannot bind {bind}: {exc}") from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def poll(self, max_messages: int = 256) -> list[tuple[bytes, wire.Message | wire.WireError]]:
        """Messages that have arrived, decoded; never blocks."""
        out: list[tuple[bytes, wire.Message | wire.WireError]] = []
        for _ in range(max_messages):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                log.warning("bootstrap: dropped a message of %d frames", len(frames))
                continue
            try:
                out.append((frames[0], wire.decode(frames[1])))
            except wire.WireError as exc:
                out.append((frames[0], exc))
        return out

    def send(self, identity: bytes, msg: wire.Message) -> bool:
        """Send to one peer; False when it is unreachable (gone, or its queue is full)."""
        try:
            self._sock.send_multipart([identity, wire.encode(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            log.debug("bootstrap: peer unreachable: %s", exc)
            return False
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
