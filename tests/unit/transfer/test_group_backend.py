"""The transfer mirror of a tensor-parallel group, with fake backends on a leader and a
follower and the step done in memory (``channel.py`` does the same over gloo: the ops the
leader queued go to the follower, which answers a state code per open room, MIN over ranks).

A room is SUCCESS only when every rank's writes landed (the leader's aux row waits for the
followers' word), FAILED when any rank's push failed;
pages wait on a follower until its own decode claimed the room there; fail and close reach
every rank."""

from __future__ import annotations

import pytest

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.tp.mirror import MirrorTarget, RankLink
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.group import FOLLOWER_FAILED, GroupBackend, GroupSender, agree
from tests.unit.scheduler.fakes import FakeBackend, FakeSender


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
