"""RouterSender on real sockets: a full pipe parks replies in order, a gone router's are
dropped and counted, parked ones included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from prefill_worker.ingress.replies import RouterSender
from tests.patience import patient
from tests.polling import wait_until

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: Ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 2)
    router.bind("tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"r1")
    dealer.setsockopt(zmq.RCVHWM, 2)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    dealer.send(b"hello")
    assert router.poll(int(patient(5.0) * 1000)) and router.recv_multipart()[0] == b"r1"
    yield router, dealer
    ctx.destroy(linger=0)


def test_a_full_pipe_parks_replies_in_order(pair) -> None:  # type: ignore[no-untyped-def]
    router, dealer = pair
    dropped: list[bool] = []
    sender = RouterSender(router, lambda: dropped.append(True))
    frames = [str(i).encode() for i in range(2000)]
    for frame in frames:
        sender.send(b"r1", frame)
    assert sender.has_parked  # the peer's pipe filled up
    got: list[bytes] = []

    def drained() -> bool:
        sender.retry_parked()
        while dealer.poll(int(patient(0.0) * 1000)):
            got.append(dealer.recv())
        return len(got) == len(frames)

    wait_until(drained, 10, "every reply")
    assert got == frames and not sender.has_parked and not dropped
    assert sender.num_sent == len(frames)


def test_a_gone_router_is_dropped_and_counted(pair) -> None:  # type: ignore[no-untyped-def]
    router, _ = pair
    dropped: list[bool] = []
    sender = RouterSender(router, lambda: dropped.append(True))
    sender.send(b"nobody", b"x")
    assert (sender.num_unroutable, len(dropped), sender.num_sent) == (1, 1, 0)
    for i in range(2000):
        sender.send(b"r1", b"%d" % i)
    assert sender.has_parked
    num_parked = 2000 - sender.num_sent
    sender.forget(b"r1")
    assert not sender.has_parked and sender.num_unroutable == 1 + num_parked
