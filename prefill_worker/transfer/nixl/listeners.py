"""The TCP connections UCX accepts on a NIXL agent's listeners, and closing the silent ones.

UCX opens a TCP listener per interface when an agent is made (``agent.make_agent``), accepts
every connection on it and keeps the connection's fd until the peer speaks or closes; NIXL
1.5.1 has no bound or idle timeout for them, so a client that opens connections and says
nothing holds one fd each, on to the process's limit (2047 of 2048 seen). A UCX peer sends its
connection request the moment it connects (tens of bytes), so a connection on a UCX listener
that has received no byte ``grace_s`` after it was first seen is not a UCX peer's:
``SilentConnections.sweep`` shuts it down. ``shutdown(2)`` goes through a duplicate of UCX's
fd (checked to be the same socket), never ``close`` under UCX: UCX reads the end of the
stream and lets its fd go as the agent progresses (the push thread progresses an idle agent
every second), as for a client that closed.

The listeners are told apart from the process's others (ZMQ, HTTP) as the ones ``make_agent``
opened: ``note_new_listeners`` records the listening ports that appear while an agent is made.
Everything is read from ``/proc/self`` (Linux); elsewhere nothing is found and nothing closed.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from prefill_worker.lograte import RateLimitedLog

log = logging.getLogger(__name__)

_LISTEN = "0A"
_ESTABLISHED = "01"
_TCP_INFO_LEN = 256
_BYTES_RECEIVED = struct.Struct("<Q")  # tcp_info.tcpi_bytes_received (Linux 4.1 and later)
_BYTES_RECEIVED_OFFSET = 128

_ucx_ports: set[int] = set()
_ports_lock = threading.Lock()


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> fd."""
    fds: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(name)
    return fds


def _tcp_rows() -> Iterator[tuple[int, str, int]]:
    """(local port, state, inode) of every TCP socket in this network namespace."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            yield int(fields[1].rsplit(":", 1)[1], 16), fields[3], int(fields[9])


def listening_ports() -> set[int]:
    """The ports this process listens on over TCP."""
    ours = _socket_fds()
    return {port for port, state, inode in _tcp_rows() if state == _LISTEN and inode in ours}


@contextmanager
def note_new_listeners() -> Iterator[None]:
    """Record as UCX's the listening ports that appear during the ``with`` block (an agent
    being made). Agents are made at start-up, one at a time; a listener another thread opened
    meanwhile would be taken for UCX's too, and its silent connections closed after the grace
    (no peer of the worker's other listeners stays silent that long)."""
    with _ports_lock:
        before = listening_ports()
        yield
        _ucx_ports.update(listening_ports() - before)


def ucx_ports() -> frozenset[int]:
    """The listening ports agents of this process opened (``note_new_listeners``)."""
    with _ports_lock:
        return frozenset(_ucx_ports)


@contextmanager
def _same_socket(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd`` while it is still the socket ``inode`` (not closed and reused
    since it was listed), else None; the duplicate is closed on leaving, ``fd`` never."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    try:
        yield dup if os.fstat(dup.fileno()).st_ino == inode else None
    finally:
        dup.close()


def _bytes_received(fd: int, inode: int) -> int | None:
    """What the socket ``inode`` at ``fd`` has received; None when it cannot be told (gone,
    or a kernel before 4.1: never close what cannot be told apart)."""
    with _same_socket(fd, inode) as sock:
        if sock is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            return None
        if len(info) < _BYTES_RECEIVED_OFFSET + _BYTES_RECEIVED.size:
            return None
        return int(_BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_OFFSET)[0])


def _shut_down(fd: int, inode: int) -> bool:
    """``shutdown(2)`` the socket ``inode`` at ``fd``; the fd stays UCX's."""
    with _same_socket(fd, inode) as sock:
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True


class SilentConnections:
    """Connections accepted on UCX's listeners that have received nothing for ``grace_s``
    are shut down by ``sweep``; ``closed`` counts them (``prefill_worker_nixl_silent_
    connections_closed_total``)."""

    def __init__(
        self,
        grace_s: float,
        ports: Callable[[], Iterable[int]] = ucx_ports,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace_s = grace_s
        self._ports = ports
        self._clock = clock
        self._first_seen: dict[int, float] = {}  # inode -> when a sweep first saw it
        self._log = RateLimitedLog(log, 60.0)  # a client may open them by the thousand
        self.closed = 0

    def sweep(self) -> int:
        """Shut down the silent connections past their grace; how many."""
        ports = set(self._ports())
        if not ports:
            return 0
        now = self._clock()
        fds = _socket_fds()
        accepted = [
            inode
            for port, state, inode in _tcp_rows()
            if state == _ESTABLISHED and port in ports and inode in fds
        ]
        # connections gone since the last sweep are forgotten
        self._first_seen = {inode: self._first_seen.get(inode, now) for inode in accepted}
        closed = [
            inode
            for inode, since in self._first_seen.items()
            if now - since >= self.grace_s
            and _bytes_received(fds[inode], inode) == 0
            and _shut_down(fds[inode], inode)
        ]
        for inode in closed:
            del self._first_seen[inode]
        self.closed += len(closed)
        if closed:
            self._log.warning(
                now,
                "shut down %d connection(s) on the NIXL/UCX listener that sent nothing in %g s",
                len(closed),
                self.grace_s,
            )
        return len(closed)


class ListenerGuard:
    """A thread (``nixl-listener-guard``) that sweeps every ``interval_s``."""

    def __init__(self, silent: SilentConnections, interval_s: float) -> None:
        self.silent = silent
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nixl-listener-guard", daemon=True)

    def start(self) -> ListenerGuard:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        failed = RateLimitedLog(log, 600.0)
        while not self._stop.wait(self._interval_s):
            try:
                self.silent.sweep()
            except Exception as exc:  # /proc unreadable, say: fds are bounded by the limit only
                failed.warning(time.monotonic(), "the NIXL listener sweep failed: %r", exc)
