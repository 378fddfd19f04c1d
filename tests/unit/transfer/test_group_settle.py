"""A failed room's status waits for every rank's writes (``transfer/group.py``): the leader's
real push sender (``test_push_sender.Rig``, native dialect) wrapped as the group's sender, and
a follower's real ``RankBackend`` over a fake NIXL agent, the step done in memory as
``channel.py`` does it over gloo.

The follower's write of the room is still in flight when the room fails (the engine gives
up, or the leader's own write failed): the decode hears `failed` only once that write can
no longer land (released, after a refused release is retried), or past the hold's bound."""

from __future__ import annotations

import pytest

from prefill_worker.tp.mirror import MirrorTarget, RankLink
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.group import GroupSender, MirrorOp
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.nixl.rank_backend import RankBackend
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from tests.clocks import FakeClock
from tests.unit.transfer.test_push_sender import Rig
from tests.unit.transfer.test_rank_backend import HEAD_PAGE_BYTES, FakeAgent, regions, register

ROOM = 7


class RefusingAgent(FakeAgent):
    """Refuses to release the handles in ``refused`` (NIXL cannot cancel them yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[int] = set()

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self.refused:
            raise NIXL_ERRORS[0]("the write is still being copied")
        super().release_xfer_handle(handle)


class Group:
    """The leader's push sender as a group sender, one follower rank (1 of 2)."""

    def __init__(self) -> None:
        self.rig = Rig("native")
        self.rig.peer.registration = register("decode-1", 0, 1)
        self.agent = RefusingAgent()
        backend = RankBackend(self.agent, RankPlace(1, 2, 2), regions(1), 5.0, FakeClock(0.0))
        self.link, self.target = RankLink(), MirrorTarget(backend)
        local = self.rig.bound_sender(ROOM)
        self.link.mirror(MirrorOp("create", ROOM, "req-7", 16))
        self.sender = GroupSender(ROOM, local, self.link, {})
        self.step()

    def step(self) -> None:
        ops, rooms = self.link.take()
        self.target.apply(ops)
        if rooms:
            self.link.store(rooms, self.target.codes(rooms))

    def turn(self) -> list[str]:
        """The leader's hub turns; what its decode heard so far."""
        self.rig.hub.turn(self.rig.now)
        return [code for _, code, _, _ in self.rig.heard.said]


@pytest.fixture
def group() -> Group:
    group = Group()
    group.sender.send_pages([0, 1], 0)
    group.step()  # the follower's write of its heads is posted, in flight
    assert len(group.agent.posted) == 1 and group.agent.states[0] == "PROC"
    group.rig.land(0)  # the leader's own write landed: only the follower's may still land
    group.agent.refused.add(0)
    return group


@pytest.mark.parametrize("how", ["engine gives up", "leader's write fails"])
def test_failed_waits_until_the_followers_writes_settled(group: Group, how: str) -> None:
    if how == "leader's write fails":
        group.sender.send_pages([2], 2)
        group.rig.agent.handles[1].state = "ERR"
        assert group.turn() == []  # the leader's sender failed: its status is held
        assert group.sender.poll() is KVPoll.FAILED  # what the engine reads, then finishes
    group.sender.fail("the engine gave up")
    group.sender.close()
    assert group.turn() == []
    group.step()  # the fail and close reach the follower: its release is refused
    assert group.turn() == [] and not group.link.followers_settled(ROOM)
    group.step()
    assert group.turn() == []  # still refused: nothing said, however many steps
    group.agent.refused.clear()
    group.step()  # released now: settled, and the room leaves the link
    assert group.agent.released == [0] and group.link.take() == ([], [])
    assert group.turn() == ["failed"]


def test_a_follower_that_never_settles_holds_the_status_only_until_the_bound(
    group: Group,
) -> None:
    group.sender.fail("the engine gave up")
    group.sender.close()
    group.step()
    assert group.turn() == []
    group.rig.now += 5.0  # transfer.peer_timeout_s: the hold's bound
    assert group.turn() == ["failed"]


def test_a_settled_answer_from_before_the_failure_reached_the_follower_does_not_count(
    group: Group,
) -> None:
    """The follower had no write in flight at the last exchange; its pages op is queued when
    the room fails: until an exchange carries the fail, its "settled" means nothing."""
    group.agent.refused.clear()
    group.agent.states[0] = "DONE"
    group.step()  # the follower's write landed: settled, before any failure
    group.sender.send_pages([2], 2)  # the next chunk's op, queued for the follower
    group.rig.land(1)
    group.sender.fail("the engine gave up")
    assert group.turn() == [] and not group.link.followers_settled(ROOM)
    group.step()  # pages and fail together: the follower posts nothing, and says settled
    assert len(group.agent.posted) == 1 and group.link.followers_settled(ROOM)
    assert group.turn() == ["failed"]


def test_the_follower_reports_its_landed_bytes_once_in_its_step_answer(group: Group) -> None:
    """What ``serve_steps`` sends beside its forward seconds: the bytes its writes landed since
    its last answer (``tp/channel.py``), counted when ``codes`` polled them."""
    group.step()
    assert group.target.take_written_bytes() == 0  # in flight: nothing landed yet
    group.agent.states[0] = "DONE"
    group.step()
    assert group.target.take_written_bytes() == 2 * HEAD_PAGE_BYTES  # its head of 2 pages
    group.step()
    assert group.target.take_written_bytes() == 0  # reported once
