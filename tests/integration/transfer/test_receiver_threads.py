"""The decode SDK for a real engine (issue 17): a blocking ``wait`` and an asyncio
``wait_async`` beside ``poll``, every call safe from an engine thread while the I/O runs on
another (the receiver's own I/O thread, or the engine's), caller errors as exceptions with
the numbers, and the worker's layout before registering (``describe_worker``).

The worker here is scripted (a bare ROUTER and a NIXL agent of its own that sends the aux
row's notification), so each test decides when a room ends; ``test_nixl_transfer`` pushes
real KV."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zmq

from prefill_worker.transfer import KVReceiver, RoomState, describe_worker, wire
from prefill_worker.transfer.nixl.agent import nixl_agent, nixl_agent_config
from prefill_worker.transfer.wire import notif_tag
from tests.integration.transfer.conftest import Worker, small_spec
from tests.integration.transfer.peers import regions_over
from tests.patience import patient
from tests.polling import wait_until


class ScriptedWorker:
    """A ROUTER the test answers, and a NIXL agent that tells the receiver a room landed."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # NIXL's own progress thread delivers the notifications: nobody polls this agent.
        config = nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        self.agent = nixl_agent("scripted-worker", config)
        self.identity, self.decode_name = b"", ""
        self.lock = threading.Lock()  # the test thread and a helper thread both answer

    def next(self, kind: type, drive: Callable[[], None], timeout_s: float = 10.0) -> wire.Message:
        """The next message of ``kind`` (others skipped), calling ``drive`` meanwhile."""
        got: list[wire.Message] = []

        def arrived() -> bool:
            drive()
            with self.lock:
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
        with self.lock:
            self.sock.send_multipart([self.identity, wire.encode(msg)])

    def accept(self, drive: Callable[[], None]) -> None:
        register = self.next(wire.Register, drive)
        assert isinstance(register, wire.Register)
        name = self.agent.add_remote_agent(wire.unframe_metadata(register.metadata))
        self.decode_name = name.decode() if isinstance(name, bytes) else name
        ok = wire.Registered(
            is_ok=True, agent_name="scripted", heartbeat_interval_s=0.1, peer_timeout_s=30.0
        )
        self.send(ok)

    def finish(self, room: int) -> None:
        """What a push ends with: the aux row's notification, then ``status ok``."""
        self.agent.send_notif(self.decode_name, notif_tag(room))
        self.send(wire.Status(room, "ok"))

    def close(self) -> None:
        self.sock.close(linger=0)


def nothing() -> None:
    return None


@pytest.fixture
def scripted() -> Iterator[ScriptedWorker]:
    worker = ScriptedWorker()
    yield worker
    worker.close()


@pytest.fixture
def receiver_factory(
    scripted: ScriptedWorker, pool_layout: str
) -> Iterator[Callable[..., KVReceiver]]:
    made: list[KVReceiver] = []
    spec = small_spec("bfloat16", pool_layout)
    pool = np.zeros(spec.nbytes, np.uint8)

    def make(**options: object) -> KVReceiver:
        receiver = KVReceiver(
            regions_over(spec, pool), scripted.endpoint, peer_timeout_s=30.0, **options
        )
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.close()


def test_wait_blocks_until_the_room_ends_while_another_thread_does_the_io(
    scripted, receiver_factory
) -> None:
    receiver = receiver_factory()
    scripted.accept(receiver.progress)
    receiver.wait_registered(5.0)
    receiver.want(1, [3, 4], 0, 0)

    def worker_side() -> None:  # its own thread: it drives the receiver's I/O meanwhile
        scripted.next(wire.Want, receiver.progress)
        scripted.finish(1)

    with ThreadPoolExecutor(1) as pool:
        helper = pool.submit(worker_side)
        status = receiver.wait(1, timeout_s=10.0)
        helper.result(timeout=patient(10))
    assert status.state is RoomState.DONE
    assert receiver.poll(1).state is RoomState.DONE


def test_wait_times_out_naming_the_room_which_stays_wanted(scripted, receiver_factory) -> None:
    receiver = receiver_factory()
    scripted.accept(receiver.progress)
    receiver.want(2, [1], 0, 0)
    with pytest.raises(TimeoutError, match=r"room 2 still pending after 0\.05 s"):
        receiver.wait(2, timeout_s=0.05)
    assert receiver.poll(2).state is RoomState.PENDING
    scripted.send(wire.Status(2, "failed", "no luck"))
    assert receiver.wait(2, timeout_s=10.0).reason == "no luck"


def test_wait_async_with_the_receivers_own_io_thread(scripted, receiver_factory) -> None:
    receiver = receiver_factory(io_thread=True)
    scripted.accept(nothing)  # the receiver's I/O thread registers, nobody else drives it
    receiver.wait_registered(5.0)

    async def decode_engine() -> list[RoomState]:
        for room in (5, 6):
            receiver.want(room, [room], 0, 0)
        waits = [asyncio.ensure_future(receiver.wait_async(r, timeout_s=10.0)) for r in (5, 6)]
        for _ in range(2):
            want = await asyncio.to_thread(scripted.next, wire.Want, nothing)
            assert isinstance(want, wire.Want)
            scripted.finish(want.room)
        return [status.state for status in await asyncio.gather(*waits)]

    assert asyncio.run(decode_engine()) == [RoomState.DONE, RoomState.DONE]


def test_wait_async_drives_progress_itself_without_an_io_thread(scripted, receiver_factory):
    receiver = receiver_factory()
    scripted.accept(receiver.progress)

    async def decode_engine() -> RoomState:
        receiver.want(7, [2], 1, 0)
        answer = asyncio.ensure_future(asyncio.to_thread(answer_abort))
        status = await receiver.wait_async(7, timeout_s=10.0)
        await answer
        return status.state

    def answer_abort() -> None:
        scripted.next(wire.Want, nothing)
        scripted.send(wire.Status(7, "aborted", "aborted by decode"))

    assert asyncio.run(decode_engine()) is RoomState.ABORTED
    with pytest.raises(TimeoutError, match="room 8 still pending"):
        receiver.want(8, [3], 1, 0)
        asyncio.run(receiver.wait_async(8, timeout_s=0.05))


def test_an_engine_thread_wants_and_polls_while_the_io_thread_progresses(
    scripted, receiver_factory
) -> None:
    """Many rooms wanted, polled and forgotten by one thread while the receiver's I/O thread
    and the worker's answers run concurrently: every room ends DONE exactly once."""
    receiver = receiver_factory(io_thread=True)
    scripted.accept(nothing)
    receiver.wait_registered(5.0)
    rooms = list(range(100, 140))
    answered = threading.Event()

    def worker_side() -> None:
        for _ in rooms:
            want = scripted.next(wire.Want, nothing)
            assert isinstance(want, wire.Want)
            scripted.finish(want.room)
        answered.set()

    with ThreadPoolExecutor(1) as pool:
        helper = pool.submit(worker_side)
        for room in rooms:
            receiver.want(room, [room % 24], room % 8, 0)
        done: set[int] = set()

        def all_done() -> bool:
            for room in rooms:
                if room not in done and receiver.poll(room).state is RoomState.DONE:
                    done.add(room)
                    receiver.forget(room)
            return len(done) == len(rooms)

        wait_until(all_done, 20.0, "every room DONE")
        helper.result(timeout=patient(10))
    assert answered.is_set()
    with pytest.raises(KeyError, match="room 100 is not wanted"):
        receiver.poll(100)


def test_caller_errors_name_what_is_wrong(scripted, receiver_factory) -> None:
    receiver = receiver_factory()
    scripted.accept(receiver.progress)
    with pytest.raises(ValueError, match=r"aux_slot 8 outside 0\.\.7"):
        receiver.want(1, [0], 8, 0)
    with pytest.raises(ValueError, match=r"room 1: page ids must be in \[0, 24\)"):
        receiver.want(1, [24], 0, 0)
    with pytest.raises(KeyError, match="room 9 is not wanted"):
        receiver.wait(9, 1.0)
    receiver.want(1, [0], 0, 0)
    with pytest.raises(ValueError, match="room 1 is already wanted"):
        receiver.want(1, [2], 0, 0)
    with pytest.raises(ValueError, match="room 1 is pending"):
        receiver.forget(1)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: ([torch.zeros(4, 4, 2, 8)], [torch.zeros(4, 4, 2, 16)]), "must match the first"),
        (lambda: ([torch.zeros(4, 4, 2, 8)] * 2, [torch.zeros(4, 4, 2, 8)]), "one K and one V"),
        (lambda: ([torch.zeros(4, 2, 8)], [torch.zeros(4, 2, 8)]), "num_pages, page_size"),
        (
            lambda: ([torch.zeros(9, 4, 2, 8)[::3]], [torch.zeros(9, 4, 2, 8)[::3]]),
            re.escape("have strides (64, 16, 8, 1)"),
        ),
    ],
    ids=["mismatch", "count", "rank", "strided-layer-major"],
)
def test_from_tensors_refuses_what_is_not_one_pool(scripted, make, why) -> None:
    ks, vs = make()
    with pytest.raises(ValueError, match=why):
        KVReceiver.from_tensors(ks, vs, scripted.endpoint)


def test_from_tensors_refuses_page_major_views_of_a_layer_major_pool(scripted) -> None:
    pool = torch.zeros(2, 2, 4, 4, 2, 8)  # [L, 2, P, ...]: layer-major
    ks, vs = list(pool[:, 0]), list(pool[:, 1])
    with pytest.raises(ValueError, match="a page_major pool's per-layer K/V views"):
        KVReceiver.from_tensors(ks, vs, scripted.endpoint, pool_layout="page_major")
    with pytest.raises(ValueError, match="num_aux_rows must be at least 1"):
        KVReceiver.from_tensors(ks, vs, scripted.endpoint, num_aux_rows=0)


def test_describe_worker_gives_the_layout_to_size_a_pool_by(workers) -> None:
    worker: Worker = workers["bfloat16"]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(describe_worker, worker.backend.bootstrap_endpoint, 10.0)
        assert worker.drive(future.done, 10.0)
        layout = future.result()
    assert layout == worker.spec.layout
    assert layout.compat_hash() == worker.spec.layout.compat_hash()
    worker.check_whole()


def test_describe_worker_times_out_naming_the_address(scripted) -> None:
    with pytest.raises(TimeoutError, match=f"no answer to describe from {scripted.endpoint}"):
        describe_worker(scripted.endpoint, 0.05)


def test_from_tensors_reads_the_pool_layout_from_the_strides(scripted) -> None:
    layer_major = torch.zeros(2, 2, 4, 4, 2, 8)  # [L, 2, P, ...]
    page_major = torch.zeros(4, 2, 2, 4, 2, 8)  # [P, L, 2, ...]
    cases = [
        (list(layer_major[:, 0]), list(layer_major[:, 1]), "layer_major"),
        (
            [page_major[:, i, 0] for i in range(2)],
            [page_major[:, i, 1] for i in range(2)],
            "page_major",
        ),
    ]
    for ks, vs, kind in cases:
        receiver = KVReceiver.from_tensors(ks, vs, scripted.endpoint, num_aux_rows=2)
        try:
            assert receiver.regions.layout.kind == kind
        finally:
            receiver.close()
