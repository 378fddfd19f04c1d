"""The publisher over real ZMQ on 127.0.0.1: what a subscriber and a replay client receive, what
is dropped and counted, and that a full queue or a bad event fails only itself.

PUB drops what it sends before a subscription has arrived, so a subscriber first ``sync``s:
probes go out until one arrives, then a marker, and everything up to the marker is skipped."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from prefill_worker.kv_events import KVEventPublisher, KVEventsError
from prefill_worker.kv_events.wire import (
    END_OF_REPLAY_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventGroup,
    KVEventBatch,
    seq_frame,
)
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.telemetry import KVEventsTelemetry
from tests.polling import wait_until

LOCAL = "tcp://127.0.0.1:0"
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_MARKERS = itertools.count(10**12)
DENSE_STORED = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}  # the default group


class Recorder:
    """The observer seam: what the publisher counted."""

    def __init__(self) -> None:
        self.published = 0
        self.dropped: Counter[str] = Counter()
        self.replays: Counter[str] = Counter()

    def on_published(self, num_events: int) -> None:
        self.published += num_events

    def on_dropped(self, reason: str, num_events: int) -> None:
        self.dropped[reason] += num_events

    def on_replay(self, outcome: str) -> None:
        self.replays[outcome] += 1


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)

    def recv(self, timeout_s: float = 10.0) -> tuple[bytes, int, KVEventBatch]:
        assert self.sock.poll(int(timeout_s * 1000)), "no message"
        topic, seq, payload = self.sock.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), _DECODER.decode(payload)

    def sync(self, publisher: KVEventPublisher, timeout_s: float = 10.0) -> int:
        """Once subscribed, the sequence number of a marker; later messages are the test's."""
        deadline = time.monotonic() + timeout_s
        while not self.sock.poll(50):
            assert time.monotonic() < deadline, "the subscription never arrived"
            publisher.all_cleared()
        marker = next(_MARKERS)
        publisher.blocks_removed([marker])
        while True:
            _, seq, batch = self.recv()
            if any(
                isinstance(e, BlockRemoved) and e.block_hashes == [marker] for e in batch.events
            ):
                return seq

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()


class ReplayClient:
    """A plain DEALER, as Dynamo's indexer asks for a replay."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def replay(self, start_seq: int) -> list[tuple[bytes, int, bytes]]:
        self.sock.send_multipart([b"", seq_frame(start_seq)])
        got = []
        while True:
            assert self.sock.poll(10_000), "no replay answer"
            empty, topic, seq, payload = self.sock.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY_SEQ:
                assert (topic, payload) == (b"", b"")
                return got
            got.append((topic, int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()


@pytest.fixture
def make() -> Iterator[Callable[..., KVEventPublisher]]:
    made: list[KVEventPublisher] = []

    def factory(start: bool = True, **kwargs: object) -> KVEventPublisher:
        """No idle batches unless a test asks: its batches are then only those it causes."""
        kwargs.setdefault("idle_interval_s", 3600.0)
        publisher = KVEventPublisher(LOCAL, LOCAL, **kwargs)  # type: ignore[arg-type]
        made.append(publisher)
        if start:
            publisher.start()
        return publisher

    yield factory
    for publisher in made:
        publisher.close()


def events_of(replayed: list[tuple[bytes, int, bytes]]) -> list[list[object]]:
    return [_DECODER.decode(payload).events for _, _, payload in replayed]


def test_events_arrive_in_order_as_vllm_frames(make) -> None:
    recorder = Recorder()
    publisher = make(topic="kv@worker-1", observer=recorder)
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    sub = Subscriber(publisher.endpoint)
    marker_seq = sub.sync(publisher)
    publisher.blocks_stored([11, 22], None, list(range(8)), 4)
    publisher.blocks_stored([33], 22, range(8, 12), 4)
    publisher.blocks_removed([33])
    publisher.all_cleared()
    received: list[object] = []
    expected_seq = marker_seq + 1
    while len(received) < 5:
        topic, seq, batch = sub.recv()
        assert (topic, seq, batch.data_parallel_rank) == (b"kv@worker-1", expected_seq, 0)
        assert abs(batch.ts - time.time()) < 60
        received += batch.events
        expected_seq += 1
    assert received == [
        AllBlocksCleared(),  # the run's first BlockStored comes after one
        BlockStored([11, 22], None, list(range(8)), 4, None, "GPU", None, **DENSE_STORED),
        BlockStored([33], 22, [8, 9, 10, 11], 4, None, "GPU", None, **DENSE_STORED),
        BlockRemoved([33], "GPU", group_idx=0),
        AllBlocksCleared(),
    ]
    wait_until(lambda: recorder.published >= 5, what="published count")
    assert not recorder.dropped
    sub.close()


def test_each_block_is_announced_in_every_group_given(make) -> None:
    """A model whose full-attention layers vLLM splits into groups 1 and 3 (MLA here): each
    store and removal once per group, in the groups' order, naming group and kind."""
    groups = (EventGroup(1, "mla_attention"), EventGroup(3, "mla_attention"))
    publisher = make(groups=groups)
    sub = Subscriber(publisher.endpoint)
    sub.sync(publisher)
    publisher.blocks_stored([5], None, [1, 2, 3, 4], 4)
    publisher.blocks_removed([5])
    received: list[object] = []
    while len(received) < 4:
        received += [e for e in sub.recv()[2].events if not isinstance(e, AllBlocksCleared)]
    mla = {"kv_cache_spec_kind": "mla_attention"}
    assert received == [
        BlockStored([5], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=1, **mla),
        BlockStored([5], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=3, **mla),
        BlockRemoved([5], "GPU", group_idx=1),
        BlockRemoved([5], "GPU", group_idx=3),
    ]
    sub.close()


def test_a_publisher_announces_some_group() -> None:
    with pytest.raises(ValueError, match="at least one"):
        KVEventPublisher(LOCAL, None, groups=())


def test_replay_resends_held_batches_from_a_sequence_number(make) -> None:
    publisher = make(topic="t")
    sub = Subscriber(publisher.endpoint)
    first = sub.sync(publisher) + 1
    live = []
    for i in range(4):  # one batch each: the next is queued only once this one arrived
        publisher.blocks_removed([i])
        live.append(sub.recv())
    assert [seq for _, seq, _ in live] == list(range(first, first + 4))
    client = ReplayClient(publisher.replay_endpoint)
    replayed = client.replay(first + 1)
    assert [(topic, seq) for topic, seq, _ in replayed] == [(b"t", first + s) for s in (1, 2, 3)]
    assert events_of(replayed) == [batch.events for _, _, batch in live[1:]]
    assert client.replay(first + 4) == []  # nothing newer yet: only the end marker
    client.close()
    sub.close()


def test_a_bad_replay_request_fails_alone(make) -> None:
    recorder = Recorder()
    publisher = make(observer=recorder)
    publisher.blocks_removed([4])
    wait_until(lambda: recorder.published == 3, what="the run's first two batches")
    client = ReplayClient(publisher.replay_endpoint)
    client.sock.send_multipart([b"", b"\x01\x02"])  # a 2-byte sequence number
    wait_until(lambda: recorder.replays["bad_request"] == 1, what="the bad request counted")
    assert events_of(client.replay(publisher.first_seq)) == [
        [AllBlocksCleared()],
        [AllBlocksCleared(), BlockRemoved([4], "GPU", group_idx=0)],
    ]
    wait_until(lambda: recorder.replays["served"] == 1, what="the good request counted")
    assert recorder.replays == Counter(bad_request=1, served=1)
    client.close()


def test_a_replay_request_of_many_parts_fails_alone(make) -> None:
    """A request of 100,000 parts is refused by its count (its parts are dropped as read)."""
    recorder = Recorder()
    publisher = make(observer=recorder)
    wait_until(lambda: recorder.published == 1, what="the start's clear")
    client = ReplayClient(publisher.replay_endpoint)
    client.sock.send_multipart([b""] * 100_000 + [bytes(8)])
    wait_until(lambda: recorder.replays["bad_request"] == 1, what="the long request counted")
    assert events_of(client.replay(publisher.first_seq)) == [[AllBlocksCleared()]]
    wait_until(lambda: recorder.replays["served"] == 1, what="the good request counted")
    assert recorder.replays == Counter(bad_request=1, served=1)
    client.close()


def test_a_new_run_clears_subscribers_until_it_stores_a_block(make) -> None:
    """A subscriber may still hold blocks of this worker's previous run (it may have crashed):
    the run's first batch is AllBlocksCleared alone, sent at start, and every batch opens with
    one until the run's first BlockStored has gone out; none after."""
    recorder = Recorder()
    publisher = make(observer=recorder)
    wait_until(lambda: recorder.published == 1, what="the start's clear")
    publisher.blocks_removed([7])
    wait_until(lambda: recorder.published == 3, what="a removal before any store")
    publisher.blocks_stored([8], None, [1, 2, 3, 4], 4)
    wait_until(lambda: recorder.published == 5, what="the first store")
    publisher.blocks_removed([8])
    wait_until(lambda: recorder.published == 6, what="a removal after it")
    client = ReplayClient(publisher.replay_endpoint)
    assert events_of(client.replay(publisher.first_seq)) == [
        [AllBlocksCleared()],
        [AllBlocksCleared(), BlockRemoved([7], "GPU", group_idx=0)],
        [
            AllBlocksCleared(),
            BlockStored([8], None, [1, 2, 3, 4], 4, None, "GPU", None, **DENSE_STORED),
        ],
        [BlockRemoved([8], "GPU", group_idx=0)],
    ]
    client.close()


def test_an_idle_publisher_still_sends_a_batch_every_interval(make) -> None:
    """A subscriber that reconnects to a restarted worker hears from it within
    ``idle_interval_s`` without any request: AllBlocksCleared alone while the run has stored
    nothing (it forgets the old run's blocks), an empty batch once it has (a clear would
    erase what subscribers rightly hold; the sequence number shows them any gap)."""
    publisher = make(idle_interval_s=0.02)
    sub = Subscriber(publisher.endpoint)
    _, seq, batch = sub.recv()  # nobody asked: an idle batch
    assert batch.events == [AllBlocksCleared()]
    _, next_seq, batch = sub.recv()
    assert (next_seq, batch.events) == (seq + 1, [AllBlocksCleared()])
    publisher.blocks_stored([8], None, [1, 2, 3, 4], 4)
    while not any(isinstance(e, BlockStored) for e in sub.recv()[2].events):
        pass
    for _ in range(3):
        assert sub.recv()[2].events == []
    sub.close()


def test_sequence_numbers_keep_rising_across_runs(make) -> None:
    """A run's first sequence number is its start time in microseconds, so a restarted
    worker's batches follow the previous run's, as consumers that ignore old numbers need
    (Dynamo's indexer drops every batch at or below the last it applied)."""
    before_us = time.time_ns() // 1000
    first = make()
    for block in range(50):
        first.blocks_removed([block])
    sub = Subscriber(first.endpoint)
    last_seq = sub.sync(first)
    endpoint = first.endpoint
    first.close()
    second = KVEventPublisher(endpoint, None, idle_interval_s=3600.0)
    second.start()
    try:
        assert before_us <= first.first_seq < second.first_seq <= time.time_ns() // 1000
        assert second.first_seq > last_seq
        sub2 = Subscriber(endpoint)
        assert sub2.sync(second) > last_seq
        sub2.close()
    finally:
        second.close()
    sub.close()


def test_a_full_queue_drops_new_events_then_tells_subscribers_to_clear(make) -> None:
    """The engine never blocks: past ``max_queued_events`` events are dropped and counted; once
    the queue drains, AllBlocksCleared follows so no router keeps a block it may have missed the
    removal of. Seen through the replay socket, which holds every batch from 0."""
    recorder = Recorder()
    publisher = make(start=False, max_queued_events=3, observer=recorder)
    for block in range(5):
        publisher.blocks_removed([block])
    assert recorder.dropped == Counter(queue_full=2)
    publisher.start()
    wait_until(lambda: recorder.published == 6, what="the queued events and the clear")
    client = ReplayClient(publisher.replay_endpoint)
    start_clear, first, drop_clear = events_of(client.replay(publisher.first_seq))
    assert start_clear == [AllBlocksCleared()]
    assert first == [
        AllBlocksCleared(),
        *(BlockRemoved([b], "GPU", group_idx=0) for b in (0, 1, 2)),
    ]
    assert drop_clear == [AllBlocksCleared()]
    client.close()


def test_an_event_that_cannot_be_encoded_is_dropped_alone(make) -> None:
    recorder = Recorder()
    publisher = make(start=False, observer=recorder)
    publisher.blocks_removed([1])
    publisher.blocks_removed([2**64])  # outside 64 bits: a bug in the caller
    publisher.blocks_stored([3], None, [0, 1, 2, 3], 4)
    publisher.start()
    wait_until(lambda: recorder.published == 4, what="the good events")
    assert recorder.dropped == Counter(bad_event=1)
    client = ReplayClient(publisher.replay_endpoint)
    assert events_of(client.replay(publisher.first_seq)) == [
        [AllBlocksCleared()],
        [
            AllBlocksCleared(),
            BlockRemoved([1], "GPU", group_idx=0),
            BlockStored([3], None, [0, 1, 2, 3], 4, None, "GPU", None, **DENSE_STORED),
        ],
    ]
    client.close()


def test_close_sends_what_is_queued_and_drops_what_comes_after(make) -> None:
    recorder = Recorder()
    publisher = make(observer=recorder)
    sub = Subscriber(publisher.endpoint)
    marker_seq = sub.sync(publisher)
    publisher.blocks_removed([5])
    publisher.all_cleared()
    publisher.close()
    events: list[object] = []
    while len(events) < 3:
        _, seq, batch = sub.recv()
        assert seq > marker_seq
        events += batch.events
    # nothing was stored in this run, so the batch opens with a clear
    assert events == [AllBlocksCleared(), BlockRemoved([5], "GPU", group_idx=0), AllBlocksCleared()]
    assert not recorder.dropped
    num_published = recorder.published
    publisher.blocks_removed([6])
    publisher.close()  # twice is fine
    assert recorder.dropped == Counter(closed=1)
    assert recorder.published == num_published
    sub.close()


def test_an_address_in_use_is_refused_with_its_name(make) -> None:
    taken = make().endpoint
    with pytest.raises(KVEventsError, match=taken):
        KVEventPublisher(taken, None).start()


def test_without_a_replay_bind_there_is_no_replay_socket() -> None:
    publisher = KVEventPublisher(LOCAL, None)
    publisher.start()
    try:
        assert publisher.replay_endpoint is None
        sub = Subscriber(publisher.endpoint)
        sub.sync(publisher)
        sub.close()
    finally:
        publisher.close()


def test_counters_reach_prometheus(make) -> None:
    registry = CollectorRegistry()
    publisher = make(observer=KVEventsTelemetry(WorkerMetrics(registry)))

    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    publisher.blocks_stored([1, 2], None, list(range(8)), 4)
    publisher.blocks_removed([2])
    # the stored and removed events, the start's AllBlocksCleared and the one before the store
    wait_until(lambda: sample("prefill_worker_kv_events_published_total") == 4, what="published")
    client = ReplayClient(publisher.replay_endpoint)
    client.replay(publisher.first_seq)
    wait_until(
        lambda: sample("prefill_worker_kv_event_replays_total", outcome="served") == 1,
        what="replay counted",
    )
    publisher.close()
    publisher.all_cleared()
    assert sample("prefill_worker_kv_events_dropped_total", reason="closed") == 1
    client.close()


def test_a_dead_publisher_thread_never_reaches_the_engine(make) -> None:
    """A bug in the publisher thread (here: its observer raising) stops publishing; the engine's
    calls keep returning, and what they bring is counted as dropped."""

    class Exploding(Recorder):
        def on_published(self, num_events: int) -> None:
            raise RuntimeError("bug")

    recorder = Exploding()
    publisher = make(observer=recorder)

    def engine_call_dropped() -> bool:
        publisher.blocks_removed([1])  # as the engine would: it returns, whatever happened
        return recorder.dropped["closed"] > 0

    wait_until(engine_call_dropped, what="events dropped once the thread died")
    publisher.close()
