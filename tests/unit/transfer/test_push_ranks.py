"""A room whose decode runs tensor-parallel: one peer per decode rank, each with its own
`want`. The room is READY only once every rank bound; each rank's pages get its heads (token
runs when it holds a sub-range of ours), every rank gets the aux row and the status, and the
request succeeds only when every rank's `ok` went out. A rank lost or aborting ends the room
for all. On both dialects, with the push engine's fakes (``test_push_sender.Rig``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.headplan import plan_rank, slice_indices
from prefill_worker.transfer.push.window_route import FullPoolWindow
from prefill_worker.transfer.sglang.frames import Endpoint
from prefill_worker.transfer.swa_window import SlidingLayers
from tests.unit.transfer.test_push_sender import LAYOUT, Rig

ROOM = 7


def _ranks(rig: Rig, tp_size: int = 2) -> list[Any]:
    """``tp_size`` decode ranks, each holding 1/tp_size of a 2-head pool's heads (the rig's
    layout has 1 head: the slices here are made up, only the routing is under test)."""
    slices = plan_rank(2, 0, 1, 2)
    peers = []
    for rank in range(tp_size):
        peer = dataclasses.replace(
            rig.peer,
            identity=f"rank-{rank}".encode(),
            agent_name=f"rank-{rank}",
            rooms=set(),
            unmatched=set(),
            tp_rank=rank,
            tp_size=tp_size,
            head_slice=slices[rank % 2],
        )
        if hasattr(peer, "endpoint"):
            peer.endpoint = Endpoint("127.0.0.1", 6000 + rank)
        rig.hub.peers[peer.identity] = peer
        rig.ctx.pages.sliced[(peer.head_slice.src_head_offset, 1)] = f"ours-{rank}"
    return peers or [rig.hub.peers[f"rank-{r}".encode()] for r in range(tp_size)]


def _want(rank: int) -> wire.Want:
    return wire.Want.of(ROOM, [8 + rank, 10 + rank, 12 + rank, 14 + rank], rank, 0)


@pytest.fixture(params=["native", "sglang"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(request.param)


def test_ready_only_once_every_rank_bound(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    assert sender.poll() is KVPoll.BOOTSTRAPPING
    rig.hub.want(r1, _want(1))
    assert sender.poll() is KVPoll.READY and sender.peers == [r0, r1]
    assert ROOM in r0.rooms and ROOM in r1.rooms
    rig.hub.check_integrity()


def test_wants_before_the_request_bind_every_rank(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    rig.hub.want(r1, _want(1))
    rig.hub.want(r0, _want(0))
    sender = rig.hub.create_sender(ROOM, "req", 16)
    assert sender.poll() is KVPoll.READY and sender.peers == [r1, r0]


def test_each_rank_gets_its_heads_its_aux_row_and_its_ok(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, _want(1))
    sender.send_pages([1, 2, 3, 4], 0)
    first, second = rig.agent.handles
    for handle, rank in ((first, 0), (second, 1)):
        _, local, local_idx, _, remote_idx, _ = handle.args
        assert local == f"ours-{rank}"
        assert np.array_equal(local_idx, slice_indices(np.array([1, 2, 3, 4]), LAYOUT))
        dst = np.array([8 + rank, 10 + rank, 12 + rank, 14 + rank])
        assert np.array_equal(remote_idx, slice_indices(dst, LAYOUT))
    sender.send_aux(1)
    rig.land(0)
    rig.land(1)
    sender.progress()
    assert len(rig.agent.handles) == 4  # an aux row to each rank
    rig.land(2)
    rig.land(3)
    sender.progress()
    assert len(rig.ctx.events) == 2  # an `ok` for each rank
    sender.confirm_ok(True)  # one rank's went out: not yet a success
    assert sender.poll() is KVPoll.TRANSFERRING
    rig.ctx.events.pop(0)
    rig.hub.drain()
    assert rig.heard.said == [(ROOM, "ok", None, None)]
    assert sender.poll() is KVPoll.SUCCESS


def test_a_stranger_cannot_join_a_full_room(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(rig.peer, _want(2))  # TP 1: not a rank of this decode
    assert sender.peers == [r0]
    rig.hub.want(r0, _want(0))  # the same rank twice
    assert sender.peers == [r0]
    assert [s[1] for s in rig.heard.said] == ["failed", "failed"]
    rig.hub.want(r1, _want(1))
    assert sender.poll() is KVPoll.READY


def test_losing_one_rank_fails_the_room_for_every_rank(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, _want(1))
    sender.send_pages([1, 2, 3, 4], 0)
    rig.hub.drop_peer(r1, "gone")
    assert sender.poll() is KVPoll.PEER_LOST and sender.peers == [r0]
    rig.hub.turn(rig.now + 10)
    assert [s[1] for s in rig.heard.said] == ["failed", "failed"]
    rig.hub.check_integrity()
    sender.close()
    rig.hub.drain()
    assert not r0.rooms and ROOM not in rig.hub.senders
    rig.hub.check_integrity()


def test_one_rank_aborting_aborts_the_room(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, _want(1))
    rig.hub.abort(r1, ROOM)
    assert sender.poll() is KVPoll.ABORTED
    rig.hub.drain()
    assert [s[1] for s in rig.heard.said] == ["aborted", "aborted"]


def _bound_pair(rig: Rig) -> tuple[Any, Any, Any]:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, _want(1))
    return sender, r0, r1


def test_bound_names_each_rank_with_its_want_in_order(rig: Rig) -> None:
    sender, r0, r1 = _bound_pair(rig)
    assert sender.bound() == [(r0, _want(0)), (r1, _want(1))]


@pytest.mark.parametrize("lost", [0, 1])
def test_a_lost_rank_takes_only_its_own_want(rig: Rig, lost: int) -> None:
    sender, r0, r1 = _bound_pair(rig)
    rig.hub.drop_peer([r0, r1][lost], "gone")
    kept = 1 - lost
    assert sender.bound() == [([r0, r1][kept], _want(kept))]


class Unsettled:
    """A write made elsewhere (another rank's), settled when the test says."""

    num_bytes, num_descs, telemetry, prep_s, prep_cpu_s, is_refused = 0, 0, None, 0.0, 0.0, False

    def __init__(self) -> None:
        self.is_settled = False

    def state(self) -> str:
        return "DONE" if self.is_settled else "PROC"

    def release(self) -> None:
        """Nothing here: its own rank releases it."""


def test_a_failure_waits_for_every_write_made_elsewhere_an_ok_for_none(rig: Rig) -> None:
    failing, ok = rig.bound_sender(7), rig.hub.create_sender(8, "req-8", 16)
    rig.hub.want(rig.peer, wire.Want.of(8, [7, 8, 9, 10], 3, 0))
    others = [Unsettled(), Unsettled()]
    for sender in (failing, ok):
        for other in others:
            sender.also_wait_for(other)  # type: ignore[arg-type]
    ok.send_pages([0], 0)
    ok.send_aux(2)
    rig.land(0)
    ok.progress()  # the aux row is posted
    rig.land(1)
    ok.progress()
    failing.fail("the engine gave up")
    rig.hub.drain()
    assert rig.heard.said == [(8, "ok", None, None)]  # an `ok` waits for no other rank
    others[1].is_settled = True
    rig.hub.turn(rig.now)
    assert len(rig.heard.said) == 1  # the first rank's write may still land
    others[0].is_settled = True
    rig.hub.turn(rig.now)
    assert rig.heard.said[1][:2] == (7, "failed")


def test_a_rank_binding_a_failed_room_alone_hears_why(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    sender.fail("the engine gave up")
    rig.hub.drain()
    rig.hub.want(r1, _want(1))
    rig.hub.drain()
    assert [s[1] for s in rig.heard.said] == ["failed", "failed"]  # r0 once, then r1 once


def test_ranks_that_disagree_on_the_cached_prefix_fail_the_room(rig: Rig) -> None:
    r0, r1 = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, wire.Want.of(ROOM, [9, 11, 13], 1, 4))
    assert sender.poll() is KVPoll.FAILED
    assert sender.failure_reason() == "the decode ranks' wants differ in num_cached_tokens"


def test_only_the_named_agent_may_bind_first(rig: Rig) -> None:
    r0, _ = _ranks(rig)
    sender = rig.hub.create_sender(ROOM, "req", 16, allowed_peer="rank-0")
    rig.hub.want(r0, _want(0))
    assert sender.peers == [r0]


@pytest.mark.parametrize(("tp_rank", "tp_size"), [(1, 4), (2, 2)])
def test_a_peer_of_another_size_or_past_a_full_room_is_no_sibling(
    rig: Rig, tp_rank: int, tp_size: int
) -> None:
    """Rank 1 of a TP-4 decode beside a TP-2 one; a third "rank" of a full TP-2 room."""
    sender, r0, _ = _bound_pair(rig)
    if tp_size == 4:
        rig.hub.drop_peer(sender.peers[1], "gone")
        sender = rig.hub.create_sender(ROOM + 1, "req-1", 16)
        rig.hub.want(r0, wire.Want.of(ROOM + 1, [8, 10, 12, 14], 0, 0))
    stranger = dataclasses.replace(r0, identity=b"s", agent_name="s", rooms=set(),
                                   unmatched=set(), tp_rank=tp_rank, tp_size=tp_size)  # fmt: skip
    assert not sender.accepts_rank(stranger)


def test_a_rank_fed_nothing_gets_no_page_write_and_a_sliced_write_counts_its_heads() -> None:
    rig = Rig("native")
    pages = dataclasses.replace(rig.ctx.pages, head_bytes=32, sliced={})
    object.__setattr__(rig.ctx, "pages", pages)  # one head of one token: 32 bytes
    r0, r1 = _ranks(rig)
    r0.head_slice = plan_rank(4, 0, 1, 2)[0]  # two heads, as token runs
    pages.sliced[(0, 2)] = "ours-0"
    r1.is_fed = False  # another prefill rank writes its heads
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, _want(1))
    sender.send_pages([1, 2], 0)
    assert len(rig.agent.handles) == 1  # rank 0's only
    rig.land(0)
    sender.progress()
    num_runs = len(rig.agent.handles[0].args[2])
    assert num_runs and sender.transfer_stats().bytes == num_runs * 2 * 32


def test_a_rank_fed_nothing_does_not_hold_back_the_next_ranks_writes() -> None:
    rig = Rig("native")
    r0, r1 = _ranks(rig)
    r0.is_fed = False  # the first rank's heads come from another prefill rank
    sender = rig.hub.create_sender(ROOM, "req", 16)
    rig.hub.want(r0, _want(0))
    rig.hub.want(r1, _want(1))
    sender.send_pages([1, 2], 0)
    [write] = rig.agent.handles
    assert write.args[1] == "ours-1"  # rank 1's heads, written all the same


def test_a_windowed_pool_writes_each_rank_its_routed_token_runs() -> None:
    """A windowed sliding pool (``push.window_route``) into decode ranks of head slices: the
    route's token runs, from our slice's list, the slice's bytes a run (not a whole page's)."""
    rig = Rig("native")
    rig.ctx = dataclasses.replace(rig.ctx, pages=dataclasses.replace(rig.ctx.pages, head_bytes=5))
    rig.hub.ctx = rig.ctx
    layers = SlidingLayers((0,), 2, 7, pool_pages=3)
    ranks = _ranks(rig)
    for peer in ranks:
        peer.route = FullPoolWindow(layers, LAYOUT.num_pages, LAYOUT.num_pages, 4, runs=4)
    sender = rig.hub.create_sender(ROOM, "req", 16)
    for rank, peer in enumerate(ranks):
        rig.hub.want(peer, _want(rank))
    sender.send_pages([1, 2, 3, 4], 0, [-1, 2, 0, 1])  # the window [9, 16): pages 2, 3
    assert len(rig.agent.handles) == 4  # full layers and sliding layers, per rank
    for rank in range(2):
        full, part = rig.agent.handles[2 * rank : 2 * rank + 2]
        dst = np.array([8 + rank, 10 + rank, 12 + rank, 14 + rank])
        sliding = np.array([-1, 2, 0, 1])
        expected = ranks[rank].route.writes(_want(rank), 16, np.arange(1, 5), dst, 0, sliding)
        for handle, write in zip((full, part), expected, strict=True):
            _, local, local_idx, _, remote_idx, _ = handle.args
            assert local == f"ours-{rank}"
            assert np.array_equal(local_idx, write.local)
            assert np.array_equal(remote_idx, write.remote)
    for index in range(4):
        rig.land(index)
    sender.progress()
    runs = 4 * 2 * 4 + 2 * 2 * 4  # the full layer's 4 pages, the window's 2, K and V, 4 tokens
    assert sender.transfer_stats().bytes == 2 * runs * 5  # a run: one head of 5 bytes
