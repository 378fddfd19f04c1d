"""The decode SDK against a scripted worker (a bare ROUTER in this test): it registers again by
itself when told it is unknown, repeats the refused wants, times pending rooms out through an
abort, and reports caller errors as exceptions with the room in the text."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from prefill_worker.transfer import KVReceiver, RoomState, wire
from tests.integration.transfer.conftest import small_spec
from tests.integration.transfer.peers import regions_over
from tests.polling import wait_until

REGISTERED = wire.Registered(
    is_ok=True, agent_name="scripted", heartbeat_interval_s=0.1, peer_timeout_s=30.0
)


class ScriptedWorker:
    """A ROUTER the test answers by hand; records what the receiver sent."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity = b""

    def next(self, receiver: KVReceiver, kind: type, timeout_s: float = 5.0) -> wire.Message:
        """The next message of ``kind`` from the receiver (heartbeats skipped)."""
        got: list[wire.Message] = []

        def arrived() -> bool:
            receiver.progress()
            while self.sock.poll(0):
                self.identity, frame = self.sock.recv_multipart()
                msg = wire.decode(frame)
                if isinstance(msg, kind):
                    got.append(msg)
                    return True
            return False

        wait_until(arrived, timeout_s, kind.__name__)
        return got[0]

    def send(self, msg: wire.Message) -> None:
        self.sock.send_multipart([self.identity, wire.encode(msg)])

    def accept(self, receiver: KVReceiver) -> None:
        self.next(receiver, wire.Register)
        self.send(REGISTERED)
        wait_until(lambda: receiver.is_registered, 5.0, "registered")


@pytest.fixture
def rig(pool_layout: str) -> Iterator[tuple[ScriptedWorker, KVReceiver]]:
    spec = small_spec("bfloat16", pool_layout)
    pool = np.zeros(spec.nbytes, np.uint8)
    worker = ScriptedWorker()
    receiver = KVReceiver(
        regions_over(spec, pool), worker.endpoint, peer_timeout_s=30.0, room_timeout_s=60.0
    )
    worker.accept(receiver)
    yield worker, receiver
    receiver.close()
    worker.sock.close(linger=0)


def test_unknown_peer_status_registers_again_and_repeats_the_want(rig) -> None:
    """And every other want sent before (the connection may have been replaced: the worker
    fails what the old one held where nobody hears it)."""
    worker, receiver = rig
    receiver.want(1, [3, 4], 0, 0)
    want = worker.next(receiver, wire.Want)
    receiver.want(7, [6], 1, 0)
    other = worker.next(receiver, wire.Want)
    worker.send(wire.Status(1, "failed", "decode peer not registered", "unknown_peer"))
    worker.accept(receiver)  # it registered again by itself
    assert [worker.next(receiver, wire.Want) for _ in range(2)] == [want, other]  # repeated
    assert receiver.poll(1).state is RoomState.PENDING
    worker.send(wire.Status(1, "failed", "bad luck"))
    wait_until(lambda: receiver.poll(1).state is RoomState.FAILED, 5.0)
    assert receiver.poll(1).reason == "bad luck"


def test_unknown_peer_message_registers_again_and_repeats_pending_wants(rig) -> None:
    worker, receiver = rig
    receiver.want(6, [2], 0, 0)
    want = worker.next(receiver, wire.Want)
    worker.send(wire.UnknownPeer("decode peer not registered"))
    worker.accept(receiver)
    assert worker.next(receiver, wire.Want) == want


def test_an_unknown_peer_answering_a_message_before_the_register_repeats_no_later_want(
    rig,
) -> None:
    """A slow worker answers two heartbeats the decode sent before it learned it was unknown:
    the second `unknown_peer` comes after the decode registered again and wanted a new room.
    The worker gets that want after the register and holds it: only the want sent before the
    register is repeated (a repeat of the other would be refused as a duplicate)."""
    worker, receiver = rig
    receiver.want(1, [3], 0, 0)
    first = worker.next(receiver, wire.Want)
    worker.send(wire.UnknownPeer("decode peer not registered"))
    worker.next(receiver, wire.Register)
    receiver.want(2, [4], 1, 0)
    assert worker.next(receiver, wire.Want).room == 2
    worker.send(wire.UnknownPeer("decode peer not registered"))  # the older heartbeat's
    worker.send(REGISTERED)
    wait_until(lambda: receiver.is_registered, 5.0, "registered")
    receiver.want(3, [5], 2, 0)  # sent after any repeat: it ends what the worker reads
    repeated = []
    while (want := worker.next(receiver, wire.Want)).room != 3:
        repeated.append(want)
    assert repeated == [first]


def test_an_old_worker_without_codes_still_fails_the_room(rig) -> None:
    worker, receiver = rig
    receiver.want(2, [3], 0, 0)
    worker.next(receiver, wire.Want)
    worker.send(wire.Status(2, "failed", "decode peer not registered"))
    wait_until(lambda: receiver.poll(2).state is RoomState.FAILED, 5.0)


def test_a_pending_room_times_out_through_an_abort(rig) -> None:
    worker, receiver = rig
    receiver.room_timeout_s = 0.05
    receiver.want(3, [5], 1, 0)
    worker.next(receiver, wire.Want)
    assert worker.next(receiver, wire.Abort) == wire.Abort(3)
    assert receiver.poll(3).state is RoomState.PENDING  # a write may still land until acked
    worker.send(wire.Status(3, "aborted", "aborted by decode"))
    wait_until(lambda: receiver.poll(3).state is RoomState.FAILED, 5.0)
    assert receiver.poll(3).reason == "room 3 still pending after 0.05 s"


def test_caller_errors_are_exceptions_that_name_the_room(rig) -> None:
    _, receiver = rig
    receiver.want(4, [1], 0, 0)
    with pytest.raises(ValueError, match="room 4 is already wanted"):
        receiver.want(4, [2], 0, 0)
    with pytest.raises(ValueError, match="room 4 is pending"):
        receiver.forget(4)
    with pytest.raises(KeyError, match="room 5 is not wanted"):
        receiver.poll(5)
    with pytest.raises(ValueError, match=r"aux_slot 99 outside 0\.\.7"):
        receiver.read_aux(99)
