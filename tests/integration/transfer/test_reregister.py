"""A decode the worker dropped registers again and keeps the room it wanted meanwhile: the real
worker (native backend, real NIXL) and the real decode SDK, over a ZMQ hop the test releases by
hand, so the order a loaded machine produces comes without timing.

The worker drops the decode (silent past its peer timeout, on the worker's clock) while two
heartbeats are on their way; it answers both `unknown_peer`. The decode hears the first,
registers again and wants room 2; then it hears the second. The worker gets the want after the
register and holds it, so the decode must not repeat it: the worker would refuse the repeat as
`duplicate want for 2`, failing a room that was fine (the push bench under load).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from prefill_worker.kv.aux import AuxRow
from prefill_worker.kv.layout import LAYER_MAJOR
from prefill_worker.transfer import KVReceiver, RoomState, RoomStatus, wire
from prefill_worker.transfer.base import KVPoll
from tests.clocks import FakeClock
from tests.integration.transfer.conftest import PEER_TIMEOUT_S, Worker, small_spec
from tests.integration.transfer.peers import regions_over
from tests.polling import wait_until

HEARTBEAT_S = 1.0


@pytest.fixture(scope="module")
def pool_layout() -> str:
    """The ordering is the point, not the pool: one layout."""
    return LAYER_MAJOR


class Hop:
    """Between the decode and the worker: what each side sends waits here until forwarded."""

    def __init__(self, worker_endpoint: str) -> None:
        ctx = zmq.Context.instance()
        self._front = ctx.socket(zmq.ROUTER)  # the decode connects here
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.bind("tcp://127.0.0.1:*")
        self.endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self._back = ctx.socket(zmq.DEALER)  # one connection to the worker, as the decode's
        self._back.setsockopt(zmq.LINGER, 0)
        self._back.connect(worker_endpoint)
        self._decode = b""
        self.up: list[wire.Message] = []  # decode -> worker, held
        self.down: list[wire.Message] = []  # worker -> decode, held
        self.num_heartbeats = 0  # from the decode, ever

    def collect(self) -> None:
        while self._front.poll(0):
            self._decode, frame = self._front.recv_multipart()
            self.up.append(wire.decode(frame))
            self.num_heartbeats += isinstance(self.up[-1], wire.Heartbeat)
        while self._back.poll(0):
            self.down.append(wire.decode(self._back.recv()))

    def forward_up(self) -> None:
        for msg in self.up:
            self._back.send(wire.encode(msg))
        self.up.clear()

    def forward_down(self, count: int | None = None) -> None:
        count = len(self.down) if count is None else count
        for msg in self.down[:count]:
            self._front.send_multipart([self._decode, wire.encode(msg)])
        del self.down[:count]

    def count(self, held: list[wire.Message], kind: type) -> int:
        self.collect()
        return sum(isinstance(m, kind) for m in held)

    def close(self) -> None:
        self._front.close(linger=0)
        self._back.close(linger=0)


@pytest.fixture
def rig(pool_layout: str) -> Iterator[tuple[Worker, Hop, KVReceiver, FakeClock, FakeClock]]:
    spec = small_spec("bfloat16", pool_layout)
    worker_clock, decode_clock = FakeClock(1000.0), FakeClock(1000.0)
    worker = Worker(spec, clock=worker_clock)
    hop = Hop(worker.backend.bootstrap_endpoint)
    pool = np.zeros(spec.nbytes, np.uint8)
    receiver = KVReceiver(
        regions_over(spec, pool),
        hop.endpoint,
        clock=decode_clock,
        heartbeat_interval_s=HEARTBEAT_S,
        peer_timeout_s=1000.0,
    )
    yield worker, hop, receiver, worker_clock, decode_clock
    receiver.close()
    hop.close()
    worker.backend.close()


def test_a_decode_registering_again_keeps_the_room_it_wanted_meanwhile(rig) -> None:
    worker, hop, receiver, worker_clock, decode_clock = rig
    backend = worker.backend

    def pump() -> None:  # the hop forwards everything at once: an ordinary network
        hop.collect()
        hop.forward_up()
        hop.forward_down()
        backend.poll()
        receiver.progress()  # NIXL progress too: no I/O thread

    # Registered, and its first heartbeat (sent at once, the decode's clock still) passed on.
    wait_until(
        lambda: pump() or (receiver.is_registered and hop.num_heartbeats == 1), 10.0, "registered"
    )

    def dropped() -> bool:  # the decode holds still; each turn is past the peer timeout
        hop.collect()
        hop.forward_up()
        worker_clock.now += PEER_TIMEOUT_S + 1
        backend.poll()
        return backend.num_peers == 0

    wait_until(dropped, 10.0, "the worker dropping the decode")
    for _ in range(2):  # two heartbeats leave before the decode hears anything
        decode_clock.now += HEARTBEAT_S
        receiver.progress()
    wait_until(lambda: hop.count(hop.up, wire.Heartbeat) == 2, 5.0, "the heartbeats")
    hop.forward_up()
    wait_until(lambda: backend.poll() or hop.count(hop.down, wire.UnknownPeer) == 2, 5.0, "unknown")
    first = next(i for i, m in enumerate(hop.down) if isinstance(m, wire.UnknownPeer))
    hop.forward_down(first + 1)
    wait_until(lambda: not receiver.is_registered, 5.0, "registering again")
    lay = worker.spec.layout
    dst = [5, 9, 2]
    receiver.want(2, dst, 3, 0)  # after the register: the new registration gets it
    wait_until(lambda: hop.count(hop.up, wire.Want) == 1, 5.0, "the want")
    hop.forward_up()
    wait_until(lambda: backend.poll() or hop.count(hop.down, wire.Registered) == 1, 5.0, "ok")
    hop.forward_down()  # the second `unknown_peer`, then `registered`
    wait_until(lambda: receiver.is_registered, 5.0, "registered again")

    num_tokens = len(dst) * lay.page_size
    sender = backend.create_sender(2, "req-2", num_tokens)
    wait_until(lambda: pump() or sender.poll() is KVPoll.READY, 5.0, "bound")
    src = worker.alloc(len(dst))
    sender.send_pages(src, 0)
    row = worker.aux.try_alloc()
    assert row is not None
    aux = AuxRow(77, -0.5, num_tokens, 0)
    worker.aux.write(row, aux)
    sender.send_aux(row)
    wait_until(lambda: pump() or sender.poll().is_terminal, 5.0, "sent")
    assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()

    def ended() -> bool:
        pump()
        return receiver.poll(2).state is not RoomState.PENDING

    wait_until(ended, 5.0, "room 2's outcome")
    assert receiver.poll(2) == RoomStatus(RoomState.DONE)
    assert receiver.read_aux(3) == aux
    assert backend.reject_counts.get("duplicate_want", 0) == 0
    sender.close()
    worker.aux.free(row)
    worker.pages.free(src)
    worker.check_whole()
