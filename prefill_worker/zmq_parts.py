"""Reading one multipart ZMQ message from a peer, keeping at most a few of its parts.

``MAXMSGSIZE`` bounds each part, not their number: a peer may send one message of a million
empty parts, and ``recv_multipart`` would build a list of all of them. Every peer protocol here
has a small fixed number of parts (the bootstrap socket 2 with the routing id, an SGLang
control message at most ``sglang.frames.MAX_FRAMES``, a KV-events replay request 3), so the
parts past the cap are read and dropped as they come, and the caller refuses the message by its
true count. The router ingress reads its two parts the same way, inline (``dispatch.py``).

A message's connection properties (``SRCFD``, ``Peer-Address``) are read through
``peer_property``: a peer that speaks ZMTP/1.0 (a greeting of ``01 00`` and short frames, ten
bytes from a raw TCP client) has no metadata, and libzmq answers EINVAL for every property of
its messages. Such a message is not a modern ZMQ peer's and is dropped by the caller.
"""

from __future__ import annotations

import zmq

_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags cost ~1 us per call
_RCVMORE = int(zmq.RCVMORE)


def recv_parts(sock: zmq.Socket[bytes], max_parts: int) -> tuple[list[bytes], int]:
    """The next message's first ``max_parts`` parts, and how many it has; never blocks
    (``zmq.Again`` when none has arrived). A message's parts arrive together, so reading the
    rest never waits."""
    return _read_rest(sock, [sock.recv(_NOBLOCK)], max_parts)


def recv_parts_with_source(
    sock: zmq.Socket[bytes], max_parts: int
) -> tuple[list[bytes], int, str | None]:
    """``recv_parts``, and the address the message came from (ZMQ's ``Peer-Address`` property
    of its first part; TCP sockets only), None for a peer without metadata (ZMTP/1.0)."""
    first = sock.recv(_NOBLOCK, copy=False)
    parts, num_parts = _read_rest(sock, [first.bytes], max_parts)
    address = peer_property(first, "Peer-Address")
    return parts, num_parts, None if address is None else str(address)


def peer_property(frame: zmq.Frame, name: str | int) -> str | int | None:
    """A property of the connection ``frame`` came on, None where the peer has no metadata
    (a ZMTP/1.0 peer: libzmq raises EINVAL for it)."""
    try:
        return frame.get(name)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EINVAL:
            raise
        return None


def _read_rest(
    sock: zmq.Socket[bytes], parts: list[bytes], max_parts: int
) -> tuple[list[bytes], int]:
    num_parts = 1
    while sock.get(_RCVMORE):
        part = sock.recv(_NOBLOCK)
        num_parts += 1
        if num_parts <= max_parts:
            parts.append(part)
    return parts, num_parts
