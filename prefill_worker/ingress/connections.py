"""Which router (ZMQ routing id) is on which TCP connection, so that a disconnect names it.

libzmq's ``ROUTER_NOTIFY`` would say so, but it is a draft API the pyzmq wheels do not build.
The stable API gives: the socket monitor reports ``ACCEPTED(fd)`` and ``DISCONNECTED(fd)`` in
order, and every message carries its connection's fd (``SRCFD``). An fd is one connection at
a time and is reused after a close; one connection has one routing id::

    monitor:   ACCEPTED(7) ....................... DISCONNECTED(7)  ACCEPTED(7) ...
    messages:        (7, id A) (7, id A) ...                              (7, id B) ...
    table:     7 → ?   7 → A                       A gone             7 → ?   7 → B

The ingress reads the monitor every turn (libzmq blocks its I/O thread rather than drop an
event) and before it files an unseen routing id, so a new id belongs to the current connection
on its fd, unless that connection already has another id or the fd has none: then it came from
an earlier connection, gone by now. Pure bookkeeping, no ZMQ.
"""

from __future__ import annotations

from collections.abc import Iterator


class RouterConnections:
    """Live routing ids by connection fd; ``on_*`` return the ids whose connection ended."""

    def __init__(self) -> None:
        self._by_fd: dict[int, bytes | None] = {}  # None: accepted, no message yet
        self._fd_of: dict[bytes, int] = {}

    def __contains__(self, identity: object) -> bool:
        return identity in self._fd_of

    def __len__(self) -> int:
        return len(self._fd_of)

    def on_accepted(self, fd: int) -> Iterator[bytes]:
        previous = self._by_fd.get(fd)
        self._by_fd[fd] = None
        if previous is not None:  # its DISCONNECTED was missed; the fd is someone else's now
            del self._fd_of[previous]
            yield previous

    def on_disconnected(self, fd: int) -> Iterator[bytes]:
        identity = self._by_fd.pop(fd, None)
        if identity is not None:
            del self._fd_of[identity]
            yield identity

    def try_add(self, identity: bytes, fd: int) -> bool:
        """File a routing id first seen on connection ``fd``; False when that connection is
        gone already (read the monitor first). fd -1 (no fd: inproc) is always live."""
        if identity in self._fd_of or fd < 0:
            return True
        if fd not in self._by_fd or self._by_fd[fd] is not None:
            return False
        self._by_fd[fd] = identity
        self._fd_of[identity] = fd
        return True
