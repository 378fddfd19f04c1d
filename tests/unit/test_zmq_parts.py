"""``recv_parts`` keeps the first parts of a message of any length and counts the rest."""

from __future__ import annotations

import pytest
import zmq

from prefill_worker.zmq_parts import recv_parts, recv_parts_with_source


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
