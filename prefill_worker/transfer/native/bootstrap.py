"""The worker's bootstrap server: a ZMQ ROUTER that decode peers register, want and abort on.

Polled without blocking from the engine loop (``poll`` drains what has arrived); it only
moves and decodes frames, the NIXL backend decides what they mean. Binds 127.0.0.1 in tests;
``endpoint`` is the address actually bound (port 0 allowed).

Identity: a peer is the connection that registered it, named by its ZMQ routing id.
``ROUTER_HANDOVER`` is off, so while a connection holds a routing id a second connection
claiming the same id is ignored by ZMQ (libzmq drops "peers with duplicate ID"): it cannot
send ``bye``/``abort``/``want`` as the first. The decode SDK sets no routing id, so ZMQ gives
each connection a fresh one; after a reconnect the worker sees a new, unregistered
connection, answers ``unknown_peer``, and the SDK registers again. ZMTP heartbeats let a dead
connection release its id. A per-registration token would add nothing a routing id the
client cannot take over does not already give; CURVE (optional) authenticates the client.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import zmq
from zmq.auth.thread import ThreadAuthenticator

from prefill_worker.curve import CurveServerKeys, start_server
from prefill_worker.transfer import wire
from prefill_worker.transfer.validate import DEFAULT_MAX_MESSAGE_BYTES
from prefill_worker.zmq_parts import recv_parts

log = logging.getLogger(__name__)

MAX_REGISTERS_PER_TURN = 4  # a register costs a few ms of NIXL work (pagemap: strided lists)
_RCVHWM = 32  # a decode's wants and heartbeats are read every turn; a flood waits in TCP
_ZMTP_HEARTBEAT_MS = 1000
_ZMTP_TIMEOUT_MS = 5000


class BootstrapServer:
    """ROUTER socket: (peer identity, message or WireError) in, messages out."""

    def __init__(
        self,
        bind: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        curve: CurveServerKeys | None = None,
    ) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._auth: ThreadAuthenticator | None = None
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # see the module docstring
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # Messages queued per connection before ZMQ stops reading it (TCP pushes back on the
        # sender): what one peer can make the worker hold is RCVHWM x max_message_bytes.
        self._sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, _ZMTP_HEARTBEAT_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ZMTP_TIMEOUT_MS)
        try:
            if curve is not None:
                self._auth = start_server(self._ctx, self._sock, curve)
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"bootstrap server cannot bind {bind}: {exc}") from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def poll(
        self, max_messages: int = 256, max_registers: int = MAX_REGISTERS_PER_TURN
    ) -> list[tuple[bytes, wire.Message | wire.WireError]]:
        """Messages that have arrived, decoded; never blocks. Reading stops after
        ``max_registers`` registers (each loads NIXL metadata, the one costly message): the
        rest wait in the socket for the engine's next turn, which comes at once."""
        out: list[tuple[bytes, wire.Message | wire.WireError]] = []
        num_registers = 0
        for _ in range(max_messages):
            if num_registers >= max_registers:
                break
            try:
                frames, num_frames = recv_parts(self._sock, 2)
            except zmq.Again:
                break
            if num_frames != 2:
                error = wire.WireError(f"a message is one frame, this one has {num_frames - 1}")
                out.append((frames[0], error))
                continue
            try:
                out.append((frames[0], wire.decode(frames[1])))
            except wire.WireError as exc:
                out.append((frames[0], exc))
            num_registers += isinstance(out[-1][1], wire.Register)
        return out

    def wait(
        self, timeout_s: float, wake_fd: int | None = None, more_fds: Sequence[int] = ()
    ) -> None:
        """Block until a message can be read, ``wake_fd`` or one of ``more_fds`` is readable,
        or ``timeout_s`` passes. zmq's poller, not select: the socket's own fd is
        edge-triggered."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        for fd in (wake_fd, *more_fds):
            if fd is not None:
                poller.register(fd, zmq.POLLIN)
        poller.poll(max(0, int(timeout_s * 1000)) or 1)

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
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
