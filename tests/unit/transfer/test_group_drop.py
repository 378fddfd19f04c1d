"""A decode rank the leader drops leaves every follower too (``transfer/group.py``'s
``drop``, ``tp/mirror.py``, ``RankBackend.drop_peer``). The leader: a fake local backend
whose peers the test removes, as a hub's ``drop_peer`` does; the follower: a real
``RankBackend`` over a fake NIXL agent, the step done in memory as ``channel.py`` does it.

Only a mirrored decode rank costs a ``drop``, queued after the ops before it (its rooms'
fail and close); the follower fails the rooms bound to it, releases their writes and forgets
its agent only once none can land (a refused release retried first). An unknown name is
harmless; the same name registering again is mirrored and written afresh."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.tp.mirror import MirrorTarget, RankLink
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.group import GroupBackend, GroupSender, MirrorOp
from prefill_worker.transfer.nixl.rank_backend import RankBackend
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from tests.clocks import FakeClock
from tests.unit.scheduler.fakes import FakeBackend
from tests.unit.transfer.test_group_backend import BoundPeer
from tests.unit.transfer.test_group_settle import RefusingAgent
from tests.unit.transfer.test_rank_backend import regions, register


class RemovingAgent(RefusingAgent):
    """Records the remote agents removed (``RankWriter.close``)."""

    def __init__(self) -> None:
        super().__init__()
        self.removed: list[str] = []

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)


@dataclass
class PeeredBackend(FakeBackend):
    """A leader's backend that drops peers as a hub does (``DropsPeers``)."""

    peers: set[str] = field(default_factory=set)
    num_dropped_peers: int = 0

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self.peers

    def drop(self, agent_name: str) -> None:
        self.peers.discard(agent_name)
        self.num_dropped_peers += 1


class Group:
    def __init__(self) -> None:
        self.pool, self.aux = PagePool(64), AuxPool(8)
        self.leader = PeeredBackend(self.pool, self.aux)
        self.link = RankLink()
        self.backend = GroupBackend(self.leader, self.link)
        self.agent = RemovingAgent()
        self.rank = RankBackend(self.agent, RankPlace(1, 2, 2), regions(1), 5.0, FakeClock(0.0))
        self.target = MirrorTarget(self.rank)
        self.ops: list[MirrorOp] = []

    def step(self) -> None:
        ops, rooms = self.link.take()
        self.ops += ops
        self.target.apply(ops)
        if rooms:
            self.link.store(rooms, self.target.codes(rooms))

    def bind(self, room: int, name: str) -> tuple[GroupSender, Any]:
        """A room bound to decode ``name`` (TP 1), its first pages sent and stepped over."""
        self.leader.peers.add(name)
        peer = BoundPeer(name, register(name, 0, 1))
        sender = self.backend.create_sender(room, f"r{room}", 8)
        assert isinstance(sender, GroupSender)
        local = self.leader.senders[f"r{room}"]
        want = wire.Want.of(room, [7, 5], 0, 0)
        local.bound = lambda: [(peer, want)]  # type: ignore[attr-defined]
        local.want()
        sender.send_pages([0, 1], 0)
        self.step()
        return sender, local

    def kinds(self) -> list[tuple[str, int]]:
        kinds, self.ops = [(op.kind, op.room) for op in self.ops], []
        return kinds


def test_a_dropped_peer_leaves_the_follower_after_its_rooms_ops() -> None:
    group = Group()
    sender, _ = group.bind(1, "d-a")
    assert len(group.agent.posted) == 1 and group.rank.num_peers == 1
    group.kinds()
    sender.fail("decode peer lost")  # what the engine does for the lost peer's room
    sender.close()
    group.leader.drop("d-a")
    group.backend.poll()
    group.step()
    assert group.kinds() == [("fail", 1), ("close", 1), ("drop", 0)]
    assert group.agent.released == [0] and group.agent.removed == ["d-a"]
    assert group.rank.num_peers == group.target.num_peers == 0
    group.backend.poll()
    group.step()
    assert group.kinds() == []  # dropped once


def test_the_follower_fails_a_room_the_drop_reaches_first_and_forgets_after_releasing() -> None:
    """The drop overtakes the engine's fail (the hub dropped the peer, the engine has not
    polled the room yet); the follower's release of the write in flight is refused once."""
    group = Group()
    group.bind(1, "d-a")
    group.bind(2, "d-b")  # another decode's room: untouched
    group.agent.refused.add(0)
    group.leader.drop("d-a")
    group.backend.poll()
    group.step()
    assert group.link.followers_state(1) is KVPoll.FAILED
    assert group.link.followers_state(2) is KVPoll.TRANSFERRING
    assert group.agent.removed == [] and group.rank.num_peers == 2  # its write may land
    group.agent.refused.clear()
    group.step()  # the room's settle retries the release; the agent goes at the next poll
    group.step()
    assert group.agent.released == [0] and group.agent.removed == ["d-a"]
    assert group.rank.num_peers == 1 and group.rank.decode_ranks.keys() == {"d-b"}


def test_a_peer_never_mirrored_costs_no_op_and_an_unknown_drop_is_harmless() -> None:
    group = Group()
    group.bind(1, "d-a")
    group.kinds()
    group.leader.peers.add("d-never")
    group.leader.drop("d-never")
    group.backend.poll()
    group.step()
    assert group.kinds() == []
    group.target.apply([MirrorOp("drop", 0, agent_names=["d-unknown"])])
    assert group.rank.num_peers == 1 and group.agent.removed == []


def test_a_missing_peer_is_looked_for_only_when_the_backend_dropped_one() -> None:
    group = Group()
    group.bind(1, "d-a")
    group.kinds()
    group.leader.peers.discard("d-a")  # gone, but the backend counted no drop
    group.backend.poll()
    group.step()
    assert group.kinds() == []
    group.leader.peers.add("d-a")
    group.leader.drop("d-other")  # a drop: looked at once, then not again until the next
    group.backend.poll()
    group.leader.peers.discard("d-a")
    group.backend.poll()
    group.step()
    assert group.kinds() == []


def test_the_same_name_registering_again_is_mirrored_and_written_afresh() -> None:
    group = Group()
    sender, _ = group.bind(1, "d-a")
    sender.fail("decode peer lost")
    sender.close()
    group.leader.drop("d-a")
    group.backend.poll()
    group.step()
    group.kinds()
    group.bind(2, "d-a")  # the decode restarted under the same name
    assert group.kinds() == [("create", 2), ("peer", 2), ("bind", 2), ("pages", 2)]
    assert len(group.agent.posted) == 2 and group.link.followers_state(2) is KVPoll.TRANSFERRING
    assert group.rank.num_peers == 1


def test_a_name_registered_again_while_leaving_replaces_its_writer() -> None:
    """The follower still waits on a write to the departed agent when the same name comes
    back: the old writer goes then (its agent name is the new one's)."""
    group = Group()
    group.bind(1, "d-a")
    group.agent.refused.add(0)
    group.leader.drop("d-a")
    group.backend.poll()
    group.step()
    group.target.apply([MirrorOp("peer", 0, register=register("d-a", 0, 1))])
    assert group.agent.removed == ["d-a"] and group.rank.num_peers == 1
    group.agent.refused.clear()
    group.step()
    group.step()
    assert group.agent.removed == ["d-a"]  # the new one stays
    assert group.rank.decode_ranks.keys() == {"d-a"}


def test_a_room_of_a_name_registered_again_fails_instead_of_using_the_old_writer() -> None:
    """The same name registers again before the leader's next poll (no `drop` goes: the name
    is still a peer): the follower replaced the writer, so a later pages op of a room bound
    to the old registration fails that room (it used to post through the closed writer and
    raise KeyError out of the follower's step, stopping the group). A room of the new
    registration is written."""
    group = Group()
    sender, _ = group.bind(1, "d-a")
    group.target.apply([MirrorOp("peer", 0, register=register("d-a", 0, 1))])
    sender.send_pages([1], 1)  # (the page again: the want has two)
    group.step()
    assert group.link.followers_state(1) is KVPoll.FAILED
    assert len(group.agent.posted) == 1  # nothing posted through the replaced writer
    group.bind(2, "d-a")
    assert len(group.agent.posted) == 2 and group.link.followers_state(2) is KVPoll.TRANSFERRING
