"""``recv_parts`` keeps the first parts of a message of any length and counts the rest;
``peer_property`` reads a message's connection properties, None for a ZMTP/1.0 peer."""

from __future__ import annotations

import socket

import pytest
import zmq

from prefill_worker.zmq_parts import peer_property, recv_parts, recv_parts_with_source


def test_a_message_of_many_parts_keeps_only_the_first() -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://parts")
    push.connect("inproc://parts")
    try:
        push.send_multipart([b"a", b"b", *([b""] * 100_000)])
        push.send_multipart([b"next"])
        assert pull.poll(5000)
        assert recv_parts(pull, 2) == ([b"a", b"b"], 100_002)
        assert recv_parts(pull, 2) == ([b"next"], 1)
        with pytest.raises(zmq.Again):
            recv_parts(pull, 2)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def test_with_its_source_a_message_names_the_address_it_came_from() -> None:
    """Over TCP, the first part's ``Peer-Address`` (what SGLang's control socket checks a
    frame's claimed ip against); the parts are kept and counted as ``recv_parts`` does."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        push.send_multipart([b"a", b"b", b"c", b"d"])
        push.send_multipart([b"next"])
        assert pull.poll(5000)
        assert recv_parts_with_source(pull, 3) == ([b"a", b"b", b"c"], 4, "127.0.0.1")
        assert pull.poll(5000)
        assert recv_parts_with_source(pull, 3) == ([b"next"], 1, "127.0.0.1")
        with pytest.raises(zmq.Again):
            recv_parts_with_source(pull, 3)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


ZMTP_1_0 = b"\x01\x00" + b"\x08\x00hostile"  # empty identity, then one 7-byte frame


def test_a_zmtp_1_0_peer_has_no_source_and_no_properties() -> None:
    """A raw TCP client speaking ZMTP/1.0 reaches the socket with no metadata: libzmq raises
    EINVAL for every property, which ``peer_property`` answers as None; a ZMTP/3 peer on the
    same socket still has its address and fd."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        raw.sendall(ZMTP_1_0)
        assert pull.poll(5000)
        assert recv_parts_with_source(pull, 3) == ([b"hostile"], 1, None)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"modern")
        assert pull.poll(5000)
        frame = pull.recv(copy=False)
        assert frame.bytes == b"modern"
        assert peer_property(frame, "Peer-Address") == "127.0.0.1"
        fd = peer_property(frame, zmq.SRCFD)
        assert isinstance(fd, int) and fd >= 0
    finally:
        raw.close()
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def test_an_error_other_than_no_metadata_is_raised() -> None:
    """Only EINVAL means "no metadata"; a closed frame's error is not swallowed."""

    class Broken:
        def get(self, name: object) -> object:
            raise zmq.ZMQError(zmq.ENOTSOCK)

    with pytest.raises(zmq.ZMQError):
        peer_property(Broken(), "Peer-Address")  # type: ignore[arg-type]
