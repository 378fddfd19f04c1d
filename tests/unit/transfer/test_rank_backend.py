"""A follower rank's sender (``transfer.nixl.rank_backend``): its states as the agreement
reads them. A fake agent stands in for NIXL (the real writes: tests/reliability/
test_tensor_parallel.py); the decode ranks are the leader's `register` messages.

SUCCESS only after the mirrored aux op and every write landed; a write NIXL reports failed,
one in flight past the timeout, a bind naming an agent this rank does not know: FAILED. A
decode rank this rank feeds nothing gets no write; close releases what is in flight. A write
that landed counts its bytes for its room and for the rank's next step answer; one that
failed or is still in flight counts nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
import pytest

from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.rank_backend import RankBackend, RankSender
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from prefill_worker.transfer.push.window_route import FullPoolWindow
from prefill_worker.transfer.swa_window import SlidingLayers
from tests.clocks import FakeClock

LAYERS, HEAD_DIM, PAGE_SIZE, PAGES = 2, 4, 4, 8
HEAD_PAGE_BYTES = 2 * LAYERS * PAGE_SIZE * HEAD_DIM * 4  # one head's K and V, a page, fp32


class FakeAgent:
    """What RankWriter and RankBackend call; ``states`` says each posted write's state."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, list[int], list[int]]] = []
        self.states: dict[int, str] = {}
        self.released: list[int] = []

    def register_memory(self, table: Any, mem: str) -> str:
        return "reg"

    def deregister_memory(self, reg: str) -> None:
        pass

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata  # the test's metadata is the agent's name

    def remove_remote_agent(self, name: str) -> None:
        pass

    def prep_xfer_dlist(self, name: str, table: Any, mem: str) -> Any:
        return _Released()

    def make_prepped_xfer(self, op: str, local: Any, li: Any, remote: Any, ri: Any, n: Any) -> int:
        handle = len(self.posted)
        self.posted.append((op, list(li), list(ri)))
        self.states[handle] = "PROC"
        return handle

    def transfer(self, handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        return self.states[handle]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)


class _Released:
    def release(self) -> None:
        pass


def regions(num_heads: int) -> KVRegions:
    layout = KVLayout(LAYERS, num_heads, HEAD_DIM, "float32", PAGE_SIZE, PAGES, LAYER_MAJOR)
    step = layout.region_bytes
    k = tuple(0x10000 + i * step for i in range(LAYERS))
    v = tuple(0x10000 + (LAYERS + i) * step for i in range(LAYERS))
    return KVRegions(layout, k, v, "cpu", 0x900000, 4)


def register(name: str, rank: int, tp: int) -> wire.Register:
    regs = regions(2 // tp)
    decode_rank = wire.DecodeRank(rank, tp, rank * 2 // tp, (rank + 1) * 2 // tp)
    metadata = wire.frame_metadata(name.encode())
    return wire.Register.of(name, metadata, regs, regs.layout.compat_hash(), decode_rank)


@pytest.fixture
def rank() -> tuple[RankBackend, FakeAgent, FakeClock]:
    agent, clock = FakeAgent(), FakeClock(0.0)
    return RankBackend(agent, RankPlace(1, 2, 2), regions(1), 5.0, clock), agent, clock


def bound(backend: RankBackend, tp: int) -> RankSender:
    names = [f"d{tp}-{j}" for j in range(tp)]
    for j, name in enumerate(names):
        backend.add_peer(register(name, j, tp))
    sender = backend.create_sender(1, "r1", 8)
    sender.bind(names, [wire.Want.of(1, [7, 5], 0, 0)] * tp)
    return sender


def test_success_only_after_the_aux_op_and_every_write_landed(rank: Any) -> None:
    backend, agent, _ = rank
    sender = bound(backend, 1)
    assert sender.poll() is KVPoll.READY
    sender.send_pages([3, 4], 0)
    assert len(agent.posted) == 1 and sender.poll() is KVPoll.TRANSFERRING
    agent.states[0] = "DONE"
    assert sender.poll() is KVPoll.TRANSFERRING  # more pages may come: no aux op yet
    sender.send_aux(0)
    assert sender.poll() is KVPoll.SUCCESS and agent.released == [0]


def test_only_the_decode_ranks_this_rank_feeds_are_written(rank: Any) -> None:
    backend, agent, _ = rank
    sender = bound(backend, 2)  # rank 1 of 2 holds head 1: decode rank 1's only
    sender.send_pages([3, 4], 0)
    sender.send_aux(0)
    assert len(agent.posted) == 1
    agent.states[0] = "DONE"
    assert sender.poll() is KVPoll.SUCCESS
    assert sender.transfer_stats().bytes == 2 * HEAD_PAGE_BYTES  # whole pages of its one head


def test_a_landed_write_counts_its_bytes_for_the_room_and_the_rank(rank: Any) -> None:
    backend, agent, _ = rank
    sender = bound(backend, 1)  # its head 1 of the decode's 2: token runs, a head each
    other = backend.create_sender(2, "r2", 8)
    other.bind(["d1-0"], [wire.Want.of(2, [1, 2, 6], 0, 0)])
    sender.send_pages([3], 0)
    other.send_pages([0, 1, 2], 0)
    sender.send_pages([4], 1)
    assert sender.poll() is KVPoll.TRANSFERRING and backend.take_written_bytes() == 0
    agent.states[0] = agent.states[1] = "DONE"  # room 1's first page, room 2's three
    assert (sender.poll(), other.poll()) == (KVPoll.TRANSFERRING, KVPoll.TRANSFERRING)
    assert (sender.transfer_stats().bytes, other.transfer_stats().bytes) == (
        HEAD_PAGE_BYTES,
        3 * HEAD_PAGE_BYTES,
    )
    assert backend.take_written_bytes() == 4 * HEAD_PAGE_BYTES
    assert backend.take_written_bytes() == 0  # taken: each byte reported once
    agent.states[2] = "DONE"
    sender.poll()
    sender.poll()  # a write counts once, however often polled
    assert sender.transfer_stats().bytes == 2 * HEAD_PAGE_BYTES
    assert backend.take_written_bytes() == HEAD_PAGE_BYTES


@pytest.mark.parametrize("how", ["nixl error", "timeout", "unknown agent"])
def test_a_failed_write_or_bind_fails_the_room_and_close_releases(rank: Any, how: str) -> None:
    backend, agent, clock = rank
    sender = bound(backend, 1)
    if how == "unknown agent":
        sender.bind(["nobody"], [wire.Want.of(1, [7, 5], 0, 0)])
    else:
        sender.send_pages([3, 4], 0)
        if how == "nixl error":
            agent.states[0] = "ERR"
        else:
            clock.now = 6.0
    assert sender.poll() is KVPoll.FAILED and sender.failure_reason()
    sender.close()
    assert len(agent.released) == len(agent.posted)  # no write left in flight
    assert sender.transfer_stats().bytes == backend.take_written_bytes() == 0  # nothing landed


def pool(num_layers: int, num_heads: int, base: int) -> KVRegions:
    layout = KVLayout(num_layers, num_heads, HEAD_DIM, "float32", PAGE_SIZE, PAGES, LAYER_MAJOR)
    step, n = layout.region_bytes, num_layers
    k = tuple(base + i * step for i in range(n))
    v = tuple(base + (n + i) * step for i in range(n))
    return KVRegions(layout, k, v, "cpu", 0x900000, 4)


def test_a_draft_pool_is_written_into_a_decode_rank_that_holds_one() -> None:
    """A follower with a draft pool (``model.draft``): into a decode rank that registered a
    draft pool (one layer more) its pages go with the draft's layer, its K and V regions
    after the target's; into one without, the target's alone."""
    agent = FakeAgent()
    draft = pool(1, 1, 0x800000)
    backend = RankBackend(agent, RankPlace(1, 2, 2), regions(1), 5.0, FakeClock(0.0), draft=draft)
    rank = wire.DecodeRank(0, 1, 0, 2)
    for name, num_layers in (("plain", LAYERS), ("spec", LAYERS + 1)):
        theirs = pool(num_layers, 2, 0x100000)
        metadata = wire.frame_metadata(name.encode())
        compat = theirs.layout.compat_hash()
        backend.add_peer(wire.Register.of(name, metadata, theirs, compat, rank))
        sender = backend.create_sender(1, "r", 8)
        sender.bind([name], [wire.Want.of(1, [7], 0, 0)])
        sender.send_pages([3], 0)
    (_, plain_src, plain_dst), (_, spec_src, spec_dst) = agent.posted
    assert len(plain_src) == len(plain_dst) == 2 * LAYERS * PAGE_SIZE  # a token run per head
    assert len(spec_src) == len(spec_dst) == 2 * (LAYERS + 1) * PAGE_SIZE  # K, V of the draft too


def test_a_native_decode_names_its_draft_pool_apart_and_gets_the_draft_heads_too() -> None:
    """A native `register` (mirrored as the decode sent it) names its draft pool in ``draft``,
    its regions the target's: this rank's draft heads go beside its target heads all the
    same, into the draft pool's addresses; a decode that registered none gets the target's."""
    agent = FakeAgent()
    draft = pool(1, 1, 0x800000)
    backend = RankBackend(agent, RankPlace(1, 2, 2), regions(1), 5.0, FakeClock(0.0), draft=draft)
    rank = wire.DecodeRank(0, 1, 0, 2)
    theirs = pool(LAYERS, 2, 0x100000)
    spec = wire.DraftPool(
        k_base_addrs=(0x700000,), v_base_addrs=(0x780000,), rows_base_addr=0x600000, row_bytes=64
    )
    for name, their_draft in (("plain", msgspec.UNSET), ("spec", spec)):
        metadata = wire.frame_metadata(name.encode())
        compat = theirs.layout.compat_hash()
        msg = wire.Register.of(name, metadata, theirs, compat, rank, draft=their_draft)
        backend.add_peer(msg)
        sender = backend.create_sender(1, "r", 8)
        sender.bind([name], [wire.Want.of(1, [7], 0, 0)])
        sender.send_pages([3], 0)
    (_, plain_src, plain_dst), (_, spec_src, spec_dst) = agent.posted
    assert len(plain_src) == len(plain_dst) == 2 * LAYERS * PAGE_SIZE  # a token run per head
    assert len(spec_src) == len(spec_dst) == 2 * (LAYERS + 1) * PAGE_SIZE  # K, V of the draft too


WINDOWED = SlidingLayers((0,), LAYERS, 7, pool_pages=3)  # layer 0 slides, in its 3 pages


@pytest.mark.parametrize("tp", [1, 2])
def test_a_windowed_pool_writes_the_routes_pages(tp: int) -> None:
    """A windowed sliding pool: full layers whole, the sliding layer's window from the
    sliding pages the op carries, as the leader's route (token runs of this rank's head into
    a decode of TP 1, whole pages into its own decode rank at TP 2); one write a chunk."""
    agent, clock = FakeAgent(), FakeClock(0.0)
    ours = dataclasses.replace(regions(1), layer_pages=(3, PAGES))
    backend = RankBackend(agent, RankPlace(1, 2, 2), ours, 5.0, clock, sliding=WINDOWED)
    names = [f"d{tp}-{j}" for j in range(tp)]
    for j, name in enumerate(names):
        backend.add_peer(register(name, j, tp))
    sender = backend.create_sender(1, "r1", 16)  # 4 pages: the window [9, 16) is pages 2, 3
    want = wire.Want.of(1, [7, 5, 3, 1], 0, 0)
    sender.bind(names, [want] * tp)
    sender.send_pages([0, 1, 4, 6], 0, [-1, -1, 2, 0])
    route = FullPoolWindow(WINDOWED, PAGES, PAGES, PAGE_SIZE, PAGE_SIZE if tp == 1 else 1)
    sliding = np.array([-1, -1, 2, 0])
    parts = route.writes(want, 16, np.array([0, 1, 4, 6]), np.array([7, 5, 3, 1]), 0, sliding)
    [(_, local, remote)] = agent.posted  # the decode rank this rank feeds, one write
    assert local == [i for p in parts for i in p.local.tolist()]
    assert remote == [i for p in parts for i in p.remote.tolist()]
    assert len(local) == (4 + 2) * 2 * (PAGE_SIZE if tp == 1 else 1)
    other = backend.create_sender(2, "r2", 16)
    other.bind(names, [want] * tp)
    other.send_pages([0, 1], 0, [-1, -1])  # before the window: the full layer's pages only
    assert len(agent.posted[1][1]) == 2 * 2 * (PAGE_SIZE if tp == 1 else 1)
    other.send_pages([4, 6], 2, [2, -1])  # a window page not held: the room fails here
    assert other.poll() is KVPoll.FAILED and "not held" in (other.failure_reason() or "")
    assert len(agent.posted) == 2


def test_a_backend_without_a_windowed_pool_writes_every_region(rank: Any) -> None:
    backend, agent, _ = rank
    plain = RankBackend(agent, RankPlace(1, 2, 2), regions(1), 5.0, sliding=None)
    plain.add_peer(register("d", 0, 2))
    assert backend.decode_ranks == {} and plain.decode_ranks["d"].route is None
