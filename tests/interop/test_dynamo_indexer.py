"""The KV-event publisher, built as the daemon builds it, feeds Dynamo's own standalone KV indexer
(ai-dynamo-runtime 1.6.1, pinned): the indexer reports exactly the stored blocks a prompt shares,
forgets removed blocks and everything after AllBlocksCleared; the replay socket resends from a
sequence number to a plain ZMQ client. Skipped, saying why, without `make kv-events-deps`.

The events are the prefix cache's calls (``CacheEventSink``) made here by hand, with a
deterministic hash chain like the cache's; a running worker feeding the indexer is
``test_worker_feeds_dynamo_indexer.py``. The indexer's publisher announces a sliding-window
model whose full-attention layers vLLM 0.34 splits into groups 1 and 2 (each block stored and
removed twice, naming a group that is not 0): Dynamo 1.6.1 reads vLLM 0.34's group fields and
still scores exactly the blocks stored (a dense model's group 0: the worker's test)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from prefill_worker.kv.layout import KVLayout
from prefill_worker.kv_events import KVEventPublisher
from prefill_worker.kv_events.wire import (
    DENSE,
    END_OF_REPLAY_SEQ,
    BlockStored,
    EventGroup,
    KVEventBatch,
)
from prefill_worker.model import ModelInfo
from prefill_worker.service.config import Config
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.schema import KVEventsConfig
from prefill_worker.service.startup import kv_event_groups, start_kv_events
from tests.checkpoints import prompt
from tests.interop.dynamo import DynamoIndexer, dynamo_python
from tests.polling import wait_until

pytestmark = pytest.mark.interop

BLOCK = 16
WORKER = 1
TOPIC = "kv@prefill-worker"
MARKER = 2**63 + 5
MARKER_EVENT = {"type": "BlockRemoved", "block_hashes": [MARKER], "medium": "GPU", "group_idx": 0}


def chain(token_ids: list[int], parent: int | None = None) -> list[int]:
    """Unsigned 64-bit hashes of the full blocks, each over its parent's hash and its tokens."""
    hashes = []
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        digest = hashlib.sha256(
            (parent or 0).to_bytes(8, "big") + bytes(str(token_ids[start : start + BLOCK]), "ascii")
        ).digest()
        parent = int.from_bytes(digest[:8], "big")
        hashes.append(parent)
    return hashes


def eventually(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def two_full_groups() -> tuple[EventGroup, ...]:
    """Layers sliding, full, full, sliding, full, full: vLLM's groups [L0 L3] [L1 L4] [L2 L5]."""
    info = ModelInfo(
        "GptOssForCausalLM", 128, 512, 6, 8, 2, 64, 128, "float32", "cpu", "sdpa", None, (2,)
    )
    info = dataclasses.replace(info, sliding_window=32, sliding_layers=(0, 3))
    groups = kv_event_groups(info, KVLayout(6, 2, 64, "float32", BLOCK, 8))
    assert [g.idx for g in groups] == [1, 2]
    return groups


def make_publisher(groups: tuple[EventGroup, ...]) -> KVEventPublisher:
    """Built as the daemon builds it."""
    config = Config(
        kv_events=KVEventsConfig(
            enabled=True,
            publish_bind="tcp://127.0.0.1:0",
            replay_bind="tcp://127.0.0.1:0",
            topic=TOPIC,
        )
    )
    started = start_kv_events(config, WorkerMetrics(CollectorRegistry()), groups)
    assert isinstance(started, KVEventPublisher)
    return started


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    dynamo_python()  # skip before binding anything
    started = make_publisher(two_full_groups())
    yield started
    started.close()


@pytest.fixture
def dense_publisher() -> Iterator[KVEventPublisher]:
    """One event per call: the replay test counts batches."""
    started = make_publisher(DENSE)  # a dense model's group 0
    yield started
    started.close()


@pytest.fixture
def indexer(publisher: KVEventPublisher, tmp_path: Path) -> Iterator[DynamoIndexer]:
    """Subscribed for certain: PUB drops what it sends before the subscription arrives, so a
    probe block goes out until the indexer has it; then AllBlocksCleared empties it again."""
    started = DynamoIndexer.start(tmp_path, BLOCK, {WORKER: publisher.endpoint})
    try:
        probe = prompt(BLOCK, seed=999)
        for _ in range(50):
            publisher.blocks_stored(chain(probe), None, probe, BLOCK)
            if eventually(lambda: started.overlap_blocks(probe) == {WORKER: 1}, 0.5):
                break
        else:
            pytest.fail(f"the indexer never saw a probe block:\n{started.child.log_tail()}")
        publisher.all_cleared()
        wait_until(lambda: not started.indexed_block_hashes(), 10, "the probe cleared")
        yield started
    finally:
        started.close()


def test_the_indexer_matches_stored_blocks_exactly(publisher, indexer) -> None:
    """Prompt A is stored in two events (as chunks land), B shares A's first two blocks."""
    a = prompt(5 * BLOCK + 3, seed=1)  # 5 full blocks and a partial one (never stored)
    a_hashes = chain(a)
    publisher.blocks_stored(a_hashes[:3], None, a[: 3 * BLOCK], BLOCK)
    publisher.blocks_stored(a_hashes[3:], a_hashes[2], a[3 * BLOCK : 5 * BLOCK], BLOCK)
    b = a[: 2 * BLOCK] + prompt(2 * BLOCK, seed=2)
    b_hashes = chain(b)
    assert b_hashes[:2] == a_hashes[:2]
    publisher.blocks_stored(b_hashes[2:], b_hashes[1], b[2 * BLOCK :], BLOCK)

    wait_until(lambda: indexer.overlap_blocks(a) == {WORKER: 5}, 10, "A's 5 blocks")
    assert indexer.overlap_blocks(a + prompt(40, seed=3)) == {WORKER: 5}
    assert indexer.overlap_blocks(a[: 3 * BLOCK] + prompt(40, seed=4)) == {WORKER: 3}
    assert indexer.overlap_blocks(a[: 2 * BLOCK + 9]) == {WORKER: 2}  # only full blocks count
    assert indexer.overlap_blocks([*b, 7]) == {WORKER: 4}
    assert indexer.overlap_blocks(prompt(4 * BLOCK, seed=5)) == {}
    assert indexer.indexed_block_hashes() == set(a_hashes) | set(b_hashes)


def test_removed_blocks_no_longer_match(publisher, indexer) -> None:
    a = prompt(4 * BLOCK, seed=6)
    a_hashes = chain(a)
    publisher.blocks_stored(a_hashes, None, a, BLOCK)
    wait_until(lambda: indexer.overlap_blocks(a) == {WORKER: 4}, 10, "A stored")
    publisher.blocks_removed(a_hashes[2:][::-1])  # evicted leaf first
    wait_until(lambda: indexer.overlap_blocks(a) == {WORKER: 2}, 10, "A's last 2 blocks gone")
    assert indexer.indexed_block_hashes() == set(a_hashes[:2])
    publisher.blocks_removed(a_hashes[:2][::-1])
    wait_until(lambda: indexer.overlap_blocks(a) == {}, 10, "A gone")
    assert indexer.indexed_block_hashes() == set()


def test_all_blocks_cleared_empties_the_index(publisher, indexer) -> None:
    prompts = [prompt(3 * BLOCK, seed=seed) for seed in (7, 8)]
    for ids in prompts:
        publisher.blocks_stored(chain(ids), None, ids, BLOCK)
    wait_until(lambda: len(indexer.indexed_block_hashes()) == 6, 10, "both stored")
    publisher.all_cleared()
    wait_until(lambda: not indexer.indexed_block_hashes(), 10, "the index emptied")
    assert all(indexer.overlap_blocks(ids) == {} for ids in prompts)


def test_replay_resends_from_a_sequence_number(dense_publisher) -> None:
    """A plain DEALER asks the replay socket from the sequence number of the second of three
    batches; it gets that batch and the third, frame for frame as published (then whatever
    the idle publisher sent since: empty batches), then the end."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(dense_publisher.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(dense_publisher.replay_endpoint)
    try:
        while not sub.poll(50):  # subscribed once a probe arrives; the marker ends the probes
            dense_publisher.all_cleared()
        dense_publisher.blocks_removed([MARKER])
        while MARKER_EVENT not in msgspec.msgpack.decode(sub.recv_multipart()[2])[1]:
            pass
        live = []
        for seed in (10, 11, 12):  # one batch each: the next is queued once this one arrived
            ids = prompt(BLOCK, seed=seed)
            dense_publisher.blocks_stored(chain(ids), None, ids, BLOCK)
            live.append(next_stored(sub))
        assert [frames[0] for frames in live] == [TOPIC.encode()] * 3
        seqs = [int.from_bytes(frames[1], "big") for frames in live]
        assert seqs == list(range(seqs[0], seqs[0] + 3))
        dealer.send_multipart([b"", live[1][1]])
        replayed = []
        while not replayed or replayed[-1][2] != END_OF_REPLAY_SEQ:
            assert dealer.poll(10_000), "no replay answer"
            replayed.append(dealer.recv_multipart())
        assert replayed[:2] == [[b"", *live[1]], [b"", *live[2]]]
        assert replayed[-1] == [b"", b"", END_OF_REPLAY_SEQ, b""]
        assert all(msgspec.msgpack.decode(r[3])[1] == [] for r in replayed[2:-1])
        events = msgspec.msgpack.decode(live[2][2], type=KVEventBatch).events
        assert [type(e) for e in events] == [BlockStored]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def next_stored(sub: zmq.Socket[bytes]) -> list[bytes]:
    """The next message whose batch stores blocks (an idle publisher sends batches too)."""
    while True:
        assert sub.poll(10_000), "the subscriber got nothing"
        frames = sub.recv_multipart()
        if any(e["type"] == "BlockStored" for e in msgspec.msgpack.decode(frames[2])[1]):
            return frames
