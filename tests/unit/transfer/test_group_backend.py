"""The transfer mirror of a tensor-parallel group, with fake backends on a leader and a
follower and the step done in memory (``channel.py`` does the same over gloo: the ops the
leader queued go to the follower, which answers a state code per open room, MIN over ranks).

A room is SUCCESS only when every rank's writes landed (the leader's aux row waits for the
followers' word), FAILED when any rank's push failed;
pages wait on a follower until its own decode claimed the room there; fail and close reach
every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.tp.mirror import MirrorTarget, RankLink
from prefill_worker.tp.step import decode_step, encode_step
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.group import FOLLOWER_FAILED, GroupBackend, GroupSender, agree
from tests.unit.scheduler.fakes import FakeBackend, FakeSender
from tests.unit.transfer.test_rank_backend import register


class Group:
    def __init__(self, follower_succeeds: bool = False) -> None:
        self.pool, self.aux = PagePool(64), AuxPool(8)
        self.leader = FakeBackend(self.pool, self.aux)
        self.follower = FakeBackend(self.pool, self.aux, polls_to_success=None)
        if follower_succeeds:
            self.follower.polls_to_success = 0
        self.link = RankLink()
        self.backend = GroupBackend(self.leader, self.link)
        self.target = MirrorTarget(self.follower)

    def step(self) -> None:
        """One step of the group: the ops go over, every open room's state comes back."""
        ops, rooms = self.link.take()
        self.target.apply(ops)
        if rooms:
            self.link.store(rooms, self.target.codes(rooms))

    def open(self, room: int = 1) -> tuple[GroupSender, FakeSender, FakeSender]:
        sender = self.backend.create_sender(room, f"r{room}", 8)
        self.step()
        assert isinstance(sender, GroupSender)
        return sender, self.leader.senders[f"r{room}"], self.follower.senders[f"r{room}"]

    def push(self, sender: GroupSender) -> None:
        pages = self.pool.try_alloc(2)
        row = self.aux.try_alloc()
        assert pages is not None and row is not None
        sender.send_pages(pages, 0)
        sender.send_aux(row)


def test_the_lowest_state_wins_and_any_failure_beats_progress() -> None:
    assert agree([KVPoll.SUCCESS, KVPoll.TRANSFERRING]) is KVPoll.TRANSFERRING
    assert agree([KVPoll.SUCCESS, KVPoll.FAILED]) is KVPoll.FAILED
    assert agree([KVPoll.BOOTSTRAPPING, KVPoll.PEER_LOST]) is KVPoll.PEER_LOST
    assert agree([KVPoll.READY, KVPoll.READY]) is KVPoll.READY


def test_a_room_succeeds_only_when_every_rank_landed() -> None:
    group = Group()
    sender, mine, theirs = group.open()
    mine.want()
    theirs.want()
    group.push(sender)
    assert sender.poll() is KVPoll.BOOTSTRAPPING  # the follower's last word: not claimed
    group.step()
    assert theirs.sent and sender.poll() is KVPoll.TRANSFERRING  # its writes are in flight
    assert mine.aux == []  # the aux row (and so the status) waits for every rank's writes
    theirs.polls_to_success = 0
    group.step()
    assert sender.poll() is KVPoll.SUCCESS and len(mine.aux) == 1


def test_the_leaders_word_alone_never_makes_a_room_succeed() -> None:
    group = Group(follower_succeeds=True)
    sender = group.backend.create_sender(1, "r1", 8)
    group.leader.senders["r1"].want()
    assert isinstance(sender, GroupSender)
    group.push(sender)
    assert sender.poll() is KVPoll.TRANSFERRING  # no step yet: no follower has a sender


def test_a_followers_failure_fails_the_room() -> None:
    group = Group()
    sender, mine, theirs = group.open()
    mine.want()
    theirs.want()
    group.push(sender)
    theirs.break_("the follower's write failed")
    group.step()
    assert sender.poll() is KVPoll.FAILED
    assert sender.failure_reason() == FOLLOWER_FAILED


@pytest.mark.parametrize("claimed_late", [True, False])
def test_pages_wait_on_a_follower_until_its_decode_claimed_the_room(claimed_late: bool) -> None:
    group = Group()
    sender, mine, theirs = group.open()
    mine.want()
    if not claimed_late:
        theirs.want()
    group.push(sender)
    group.step()
    assert (theirs.sent == []) is claimed_late
    theirs.want()
    group.step()
    assert theirs.sent == mine.sent and len(theirs.aux) == 1
    assert not theirs.errors and not mine.errors


def test_fail_and_close_reach_every_rank_and_close_the_room() -> None:
    group = Group()
    sender, mine, theirs = group.open()
    sender.fail("the engine gave up")
    sender.close()
    group.step()
    assert theirs.worker_failure == "the engine gave up" and theirs.is_closed
    assert mine.is_closed and group.link.take() == ([], [])


@dataclass
class BoundPeer:
    agent_name: str
    registration: wire.Register | None


@pytest.mark.parametrize("is_native", [True, False])
def test_each_registration_is_mirrored_once_and_each_room_binds_before_its_pages(
    is_native: bool,
) -> None:
    """Native peers: their `register` once, then each room's binding before its pages. A
    peer with no registration (SGLang's): nothing to bind, the followers write nothing."""
    group = Group()
    peers = [
        BoundPeer(f"d2-{j}", register(f"d2-{j}", j, 2) if is_native else None) for j in range(2)
    ]
    ops = []
    for room in (1, 2):
        sender = group.backend.create_sender(room, f"r{room}", 8)
        wants = [wire.Want.of(room, [7 - j, 5 - j], 0, 0) for j in range(2)]
        local = group.leader.senders[f"r{room}"]
        local.bound = lambda wants=wants: list(zip(peers, wants, strict=True))  # type: ignore[attr-defined]
        local.want()
        pages = group.pool.try_alloc(2)
        assert pages is not None
        sender.send_pages(pages, 0)
        ops += group.link.take()[0]
    kinds = [(op.kind, op.room) for op in ops]
    if not is_native:
        assert kinds == [("create", 1), ("pages", 1), ("create", 2), ("pages", 2)]
        return
    assert kinds == [
        ("create", 1), ("peer", 1), ("peer", 1), ("bind", 1), ("pages", 1),
        ("create", 2), ("bind", 2), ("pages", 2),
    ]  # fmt: skip
    assert [op.register for op in ops if op.kind == "peer"] == [p.registration for p in peers]
    (bind,) = [op for op in ops if op.kind == "bind" and op.room == 2]
    assert bind.agent_names == ["d2-0", "d2-1"] and bind.wants[1].dst_page_ids.tolist() == [6, 4]


def test_a_room_failed_while_its_aux_row_is_held_never_sends_it() -> None:
    """The group fails (or the engine gives up) while the leader holds a room's aux row for
    the followers; their SUCCESS, reported after that, must not send the row (freed, maybe
    another request's by then), and the backend stops polling for it every 2 ms."""
    group = Group()
    sender, mine, theirs = group.open()
    mine.want()
    theirs.want()
    group.push(sender)
    group.step()
    assert sender.held_aux is not None and mine.aux == []
    theirs.polls_to_success = 0
    group.step()  # the followers' SUCCESS is in: the next poll would release the row
    sender.fail("tensor-parallel group failed")
    sender.close()
    group.leader.next_poll_at = lambda: math.inf  # type: ignore[attr-defined]
    group.backend.poll()
    assert mine.aux == [] and mine.errors == []
    assert sender.poll() is KVPoll.FAILED
    assert group.backend.next_poll_at() == math.inf


def test_a_windowed_pools_sliding_pages_reach_the_follower() -> None:
    """The ``pages`` op carries a windowed sliding pool's entries of the same pages (every
    rank holds the same sliding pages), through the step's encoding too."""
    group = Group()
    sender, mine, theirs = group.open()
    mine.want()
    theirs.want()
    pages = group.pool.try_alloc(2)
    assert pages is not None
    sender.send_pages(pages, 3, [5, -1])
    ops, rooms = group.link.take()
    ops = decode_step(encode_step(None, ops, rooms)).ops  # as the step carries them
    assert [op.sliding_page_ids for op in ops if op.kind == "pages"] == [[5, -1]]
    group.target.apply(ops)
    assert mine.sliding_sent == theirs.sliding_sent == [(5, -1)]
    assert theirs.sent == mine.sent == [(tuple(pages), 3)]
    sender.send_pages(pages, 5)  # no windowed pool: none
    group.step()
    assert theirs.sliding_sent == [(5, -1), ()]
