"""Reading one multipart ZMQ message from a peer, keeping at most a few of its parts.

``MAXMSGSIZE`` bounds each part, not their number: a peer may send one message of a million
empty parts, and ``recv_multipart`` would build a list of all of them. Every peer protocol here
has a small fixed number of parts (the bootstrap socket 2 with the routing id, an SGLang
control message at most ``sglang.frames.MAX_FRAMES``, a KV-events replay request 3), so the
parts past the cap are read and dropped as they come, and the caller refuses the message by its
true count. The router ingress reads its two parts the same way, inline (``dispatch.py``).
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


def recv_parts_with_source(sock: zmq.Socket[bytes], max_parts: int) -> tuple[list[bytes], int, str]:
    """``recv_parts``, and the address the message came from (ZMQ's ``Peer-Address`` property
    of its first part; TCP sockets only)."""
    first = sock.recv(_NOBLOCK, copy=False)
    parts, num_parts = _read_rest(sock, [first.bytes], max_parts)
    return parts, num_parts, str(first.get("Peer-Address"))


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
