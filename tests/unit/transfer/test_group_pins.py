"""Pins of the group's transfer seam (``transfer/group.py``) that the behaviour tests leave
open: every argument of a sender call reaches both ranks, the aux row is held only while it
waits for the followers, whose failure is whose, and the backend's waits and polls. Fakes on
a leader and a follower, the step in memory (``test_group_backend.Group``)."""

from __future__ import annotations

import math
import time

from prefill_worker.kv.aux import AuxRow
from prefill_worker.tp.mirror import RankLink, no_opinion
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.group import (
    FOLLOWER_FAILED,
    HELD_AUX_POLL_S,
    FollowerWrites,
    GroupSender,
    MirrorOp,
)
from tests.unit.transfer.test_group_backend import Group


def _opened(group: Group) -> tuple[GroupSender, object, object]:
    sender, mine, theirs = group.open()
    mine.want()
    theirs.want()
    group.leader.next_poll_at = lambda: math.inf  # type: ignore[attr-defined]
    return sender, mine, theirs


def test_every_argument_of_a_new_sender_reaches_both_ranks() -> None:
    group = Group()
    group.backend.create_sender(5, "r5", 12, allowed_peer="decode-1")
    group.step()
    for backend in (group.leader, group.follower):
        sender = backend.senders["r5"]
        assert (sender.room, sender.num_tokens, sender.allowed_peer) == (5, 12, "decode-1")


def test_the_traceparent_reaches_the_leaders_sender_only() -> None:
    """The leader's sender tells the decode, so it alone carries the request's span."""
    group = Group()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    group.backend.create_sender(5, "r5", 12, traceparent=parent)
    group.step()
    assert group.leader.senders["r5"].traceparent == parent
    assert group.follower.senders["r5"].traceparent is None


def test_pages_and_the_aux_row_reach_the_follower_as_the_leader_sent_them() -> None:
    group = Group(follower_succeeds=True)
    sender, mine, theirs = _opened(group)
    pages, (_, row) = group.pool.try_alloc(2), (group.aux.try_alloc(), group.aux.try_alloc())
    assert pages is not None and row is not None
    group.aux.write(row, AuxRow(42, -0.5, 8, 0))
    sender.send_pages(pages, 2)
    sender.send_aux(row)
    group.step()
    group.step()
    group.backend.poll()  # the followers' SUCCESS is in: the backend lets the row go
    assert theirs.sent == mine.sent == [(tuple(pages), 2)]
    assert theirs.aux == mine.aux == [AuxRow(42, -0.5, 8, 0)]


def test_a_room_binds_once_however_many_chunks() -> None:
    group = Group()
    sender, mine, _ = _opened(group)
    mine.bound = lambda: []  # type: ignore[attr-defined]
    for first in (0, 2):
        pages = group.pool.try_alloc(2)
        assert pages is not None
        sender.send_pages(pages, first)
    assert [op.kind for op in group.link.take()[0]] == ["bind", "pages", "pages"]
    assert len(mine.other_writes) == 1


def test_the_backend_polls_fast_only_while_a_row_waits() -> None:
    group = Group()
    sender, _, theirs = _opened(group)
    assert group.backend.next_poll_at() == math.inf  # nothing held
    group.push(sender)
    before = time.monotonic()
    at = group.backend.next_poll_at()
    assert before + HELD_AUX_POLL_S <= at <= time.monotonic() + HELD_AUX_POLL_S
    sender.fail("the engine gave up")  # no close yet: the row is dropped all the same
    theirs.polls_to_success = 0
    group.step()
    group.backend.poll()
    assert group.backend.next_poll_at() == math.inf


def test_a_failed_room_never_sends_a_row_its_followers_would_release() -> None:
    group = Group()
    sender, mine, theirs = _opened(group)
    group.push(sender)
    sender.fail("the engine gave up")
    theirs.polls_to_success = 0
    group.step()
    group.step()
    assert sender.poll() is KVPoll.FAILED
    assert mine.aux == [] and mine.worker_failure == "the engine gave up"


def test_the_backend_alone_releases_a_row_for_a_room_it_saw_idle() -> None:
    group = Group()
    sender, mine, theirs = _opened(group)
    group.backend.poll()  # READY: not terminal, so still watched
    group.push(sender)
    theirs.polls_to_success = 0
    group.step()
    group.step()
    group.backend.poll()
    assert len(mine.aux) == 1


def test_whose_failure_a_room_reports() -> None:
    group = Group()
    sender, mine, _ = _opened(group)
    group.step()
    assert sender.failure_reason() is None  # nobody failed
    mine.break_("the decode went away")
    assert sender.failure_reason() == "the decode went away"  # the leader's own words
    other, _, theirs2 = _opened(group_two := Group())
    theirs2.break_("its write failed")
    group_two.step()
    assert other.failure_reason() == FOLLOWER_FAILED


def test_waits_go_to_the_leaders_backend_as_given() -> None:
    group = Group()
    calls = []
    group.leader.wait = lambda t, fd=None: calls.append((t, fd))  # type: ignore[method-assign]
    group.backend.wait(0.25, 7)
    assert calls == [(0.25, 7)]


def test_follower_writes_read_done_once_settled() -> None:
    link = RankLink()
    link.mirror(MirrorOp("create", 3))
    writes = FollowerWrites(3, link)
    assert writes.state() == "PROC" and not writes.is_settled
    link.mirror(MirrorOp("close", 3))
    _, rooms = link.take()
    link.store(rooms, [6, 1])
    assert writes.state() == "DONE" and writes.is_settled


def test_an_answer_without_opinion_is_the_highest_code_then_settled() -> None:
    assert no_opinion(2) == [6, 6, 1, 1]


def test_the_link_has_work_while_ops_wait_or_rooms_are_open_or_settling() -> None:
    link = RankLink()
    assert not link.has_work()
    link.mirror(MirrorOp("create", 3))
    assert link.has_work()  # an op waits
    link.take()
    assert link.has_work()  # the room is open
    link.mirror(MirrorOp("close", 3))
    assert link.followers_state(3) is None
    link.take()
    assert link.has_work()  # closed, not settled yet
    link.store([3], [6, 0])
    assert link.has_work()
    link.store([3], [6, 1])
    assert not link.has_work()


def test_a_closed_rooms_state_is_forgotten_at_once() -> None:
    link = RankLink()
    link.mirror(MirrorOp("create", 3))
    link.store(*_taken(link, [4, 1]))
    assert link.followers_state(3) is KVPoll.READY
    link.mirror(MirrorOp("close", 3))
    assert link.followers_state(3) is None


def test_settled_counts_per_room_whatever_comes_before_it() -> None:
    link = RankLink()
    for room in (1, 2):
        link.mirror(MirrorOp("create", room))
    link.mirror(MirrorOp("fail", 2))
    link.store(*_taken(link, [6, 6, 1, 1]))
    assert not link.followers_settled(1) and link.followers_settled(2)


def test_a_room_id_used_again_starts_afresh() -> None:
    link = RankLink()
    link.mirror(MirrorOp("create", 3))
    link.mirror(MirrorOp("fail", 3))
    link.store(*_taken(link, [2, 1]))
    assert link.followers_settled(3)
    link.mirror(MirrorOp("close", 3))
    link.mirror(MirrorOp("create", 3))  # the same id before the close was exchanged
    _, rooms = link.take()
    assert rooms == [3] and not link.followers_settled(3)
    link.store(rooms, [4, 1])  # settled, but nothing asked this room to end
    assert not link.followers_settled(3)


def test_a_room_id_created_again_has_no_state_until_its_followers_answer() -> None:
    link = RankLink()
    link.mirror(MirrorOp("create", 3))
    link.store(*_taken(link, [4, 1]))
    link.mirror(MirrorOp("create", 3))
    assert link.followers_state(3) is None


def test_a_follower_ignores_a_peer_op_without_a_registration() -> None:
    group = Group()
    group.target.apply([MirrorOp("peer", 1)])  # the fake backend has no add_peer


def test_a_follower_that_cannot_bind_fails_the_room_saying_why() -> None:
    group = Group()
    _, _, theirs = group.open()
    group.target.apply([MirrorOp("bind", 1)])
    assert theirs.worker_failure == "this rank's backend cannot bind decode ranks"


def _taken(link: RankLink, answer: list[int]) -> tuple[list[int], list[int]]:
    """The next exchange's rooms and the answer the followers give them."""
    return link.take()[1], answer
