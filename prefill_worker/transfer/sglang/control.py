"""The SGLang control plane's sockets: the PULL socket decodes push their frames to (read and
parsed on its own thread), and the PUSH sockets the worker answers on (engine thread).

``ControlSocket`` binds at start-up (a taken port fails fast), then its thread parses each
message (``frames.parse``; a bad one becomes its ``FrameError``) and hands it to
``on_message`` with the connection's ``Peer-Address`` (the one thing about a frame's sender
that the sender does not write). Nothing here decides what a message means; ZMQ drops a
message over ``max_message_bytes`` before it is read. ``Mailbox`` is the hand-over: the
thread puts, the engine takes a turn's worth and can sleep on its file descriptor.

``ReplySockets`` keeps one PUSH socket per decode endpoint (as SGLang does, at most
``max_sockets``, least recently used closed first). Sends never block: a decode that is gone
or not reading makes ``send`` return False once its queue is full.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from prefill_worker.transfer.sglang.frames import (
    MAX_FRAMES,
    Endpoint,
    FrameError,
    Message,
    Registration,
    parse,
)
from prefill_worker.zmq_parts import recv_parts_with_source

log = logging.getLogger(__name__)

_SEND_HWM = 1024  # replies queued per decode before sends fail


@dataclass(frozen=True, slots=True)
class Received:
    """A parsed control message and the IP address of the connection it came in on."""

    message: Message | FrameError
    source_ip: str


class ControlSocket:
    """The PULL socket at ``host:port`` (port 0 picks one) and its reader thread."""

    def __init__(
        self,
        host: str,
        port: int,
        max_message_bytes: int,
        on_message: Callable[[Received], None],
    ) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._stop_send = self._ctx.socket(zmq.PAIR)
        self._stop_recv = self._ctx.socket(zmq.PAIR)
        self._stop_recv.bind(f"inproc://sglang-control-stop-{id(self)}")
        self._stop_send.connect(f"inproc://sglang-control-stop-{id(self)}")
        self._on_message = on_message
        bracketed = f"[{host}]" if ":" in host else host
        try:
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            if port:
                self._sock.bind(f"tcp://{bracketed}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{bracketed}")
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"SGLang control socket cannot bind {host}:{port}: {exc}") from exc
        self.endpoint = Endpoint(host, port)
        self._thread = threading.Thread(target=self._run, name="sglang-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop_send.send(b"")
            self._thread.join(timeout=5)
        self._close_sockets()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # the daemon's thread watch sees the thread stop: not live
            log.exception("sglang control socket thread stopped")

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_recv, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_recv in ready:
                return
            while True:
                try:
                    received = recv_parts_with_source(self._sock, MAX_FRAMES + 1)
                except zmq.Again:
                    break
                self._deliver(*received)

    def _deliver(self, frames: list[bytes], num_frames: int, source_ip: str | None) -> None:
        try:
            if source_ip is None:  # zmq_parts.peer_property: no SGLang decode speaks ZMTP/1.0
                raise FrameError("a peer without connection metadata (ZMTP/1.0)")
            if num_frames > MAX_FRAMES:
                raise FrameError(f"a message of {num_frames} frames (at most {MAX_FRAMES})")
            message: Message | FrameError = parse(frames)
        except FrameError as exc:
            message = exc
        self._on_message(Received(message, source_ip or ""))

    def _close_sockets(self) -> None:
        for sock in (self._sock, self._stop_send, self._stop_recv):
            sock.close(linger=0)
        self._ctx.term()


class ReplySockets:
    """PUSH sockets to decodes' control endpoints; engine thread only."""

    def __init__(self, max_sockets: int = 256) -> None:
        self._ctx = zmq.Context()
        self._socks: OrderedDict[Endpoint, zmq.Socket[bytes]] = OrderedDict()
        self._max_sockets = max_sockets

    def send(self, endpoint: Endpoint, frames: list[bytes]) -> bool:
        """Queue a message for the decode; False when it cannot take one now."""
        try:
            self._sock(endpoint).send_multipart(frames, zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            log.debug("sglang: reply to %s not sent: %s", endpoint.address, exc)
            return False
        return True

    def close(self, linger_s: float = 0.5) -> None:
        """Close every socket; replies still queued get ``linger_s`` to go out."""
        for sock in self._socks.values():
            sock.close(linger=int(linger_s * 1000))
        self._socks.clear()
        self._ctx.term()

    def _sock(self, endpoint: Endpoint) -> zmq.Socket[bytes]:
        sock = self._socks.get(endpoint)
        if sock is not None:
            self._socks.move_to_end(endpoint)
            return sock
        if len(self._socks) >= self._max_sockets:
            _, oldest = self._socks.popitem(last=False)
            oldest.close(linger=0)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        if ":" in endpoint.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint.address)
        self._socks[endpoint] = sock
        return sock


class Mailbox:
    """What the control thread hands the engine: a deque, a pipe that is readable while it
    holds something, and an optional ``wake`` for an engine that sleeps elsewhere (serving
    both protocols, it sleeps on the native socket and its inbox).

    Registrations are the one costly message (each loads NIXL metadata on the engine's
    turn): a turn takes at most a few (``take``), and other senders' messages are not held
    behind those left waiting; past ``max_waiting_registrations`` waiting, a new one is
    dropped here and handed over as a ``FrameError`` saying so (counted ``bad_message``)."""

    def __init__(
        self, wake: Callable[[], None] | None = None, max_waiting_registrations: int = 64
    ) -> None:
        self._items: deque[Received] = deque()
        self._num_registrations = 0  # of those in _items
        self._max_registrations = max_waiting_registrations
        self._lock = threading.Lock()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._is_signalled = False
        self._wake = wake or (lambda: None)

    def put(self, item: Received) -> None:
        with self._lock:
            if isinstance(item.message, Registration):
                if self._num_registrations >= self._max_registrations:
                    why = f"registration dropped: {self._num_registrations} are waiting"
                    item = Received(FrameError(why), item.source_ip)
                else:
                    self._num_registrations += 1
            self._items.append(item)
            if not self._is_signalled:
                self._is_signalled = True
                os.write(self._write_fd, b"\0")
        self._wake()

    def take(self, max_registrations: int) -> list[Received]:
        """What has arrived, but at most ``max_registrations`` registrations; those left
        wait, and so does whatever came after them from the same ``ip:port`` (a decode's
        request never overtakes its registration). The pipe stays readable while anything
        waits."""
        taken: list[Received] = []
        with self._lock:
            left: deque[Received] = deque()
            held: set[Endpoint] = set()
            for item in self._items:
                endpoint = None if isinstance(item.message, FrameError) else item.message.endpoint
                is_registration = isinstance(item.message, Registration)
                if endpoint in held or (is_registration and max_registrations <= 0):
                    left.append(item)
                    if endpoint is not None:
                        held.add(endpoint)
                    continue
                taken.append(item)
                max_registrations -= is_registration
                self._num_registrations -= is_registration
            self._items = left
            if self._is_signalled and not self._items:
                self._is_signalled = False
                os.read(self._read_fd, 64)
        return taken

    @property
    def has_items(self) -> bool:
        return bool(self._items)

    def fileno(self) -> int:
        return self._read_fd

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)
