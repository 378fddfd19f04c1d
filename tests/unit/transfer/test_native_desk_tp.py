"""The native desk admitting decode ranks of TP > 1 (``register.tp``): a rank is checked
against the KV-head rule and its pool against ours with its heads only; it gets the heads the
plan gives it and, in `registered`, the worker's TP layout. A decode that names no rank gets
v1's answer, byte for byte the same."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.headplan import HeadSlice
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from prefill_worker.transfer.validate import BootstrapLimits
from tests.unit.transfer.test_native_desk import Agent, Server
from tests.unit.transfer.test_push_sender import Rig

OURS = KVLayout(2, 4, 8, "float32", 4, 16)
OUR_REGIONS = KVRegions(OURS, (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 5 << 20, 8)
DESCRIBED = wire.Described(
    agent_name="prefill-0",
    layout=wire.Layout.of(OURS),
    compat_hash=OURS.compat_hash(),
    peer_timeout_s=9.0,
    heartbeat_interval_s=3.0,
)
ENDPOINT = "tcp://127.0.0.1:5999"


class EndpointServer(Server):
    endpoint = ENDPOINT


class Desk:
    def __init__(self) -> None:
        self.hub = Rig("native").hub
        self.server, self.agent = EndpointServer(), Agent()
        self.desk = BootstrapDesk(
            self.hub,
            self.server,  # type: ignore[arg-type]
            self.agent,
            OURS,
            BootstrapLimits(),
            DESCRIBED,
            regions=OUR_REGIONS,
        )

    def register(self, identity: bytes, num_heads: int, tp: Any = msgspec.UNSET) -> Any:
        name = identity.decode()
        layout = KVLayout(2, num_heads, 8, "float32", 4, 32)
        regions = KVRegions(layout, (1 << 30, 2 << 30), (3 << 30, 4 << 30), "cpu", 5 << 30, 4)
        metadata = wire.frame_metadata(name.encode())
        msg = wire.Register.of(name, metadata, regions, layout.compat_hash(), tp)
        self.desk.dispatch(identity, msg)
        return self.server.sent[-1][1]


@pytest.fixture
def d() -> Desk:
    return Desk()


def test_a_decode_rank_gets_its_heads_and_the_worker_layout(d: Desk) -> None:
    reply = d.register(b"rank-1", 2, wire.DecodeRank(1, 2, 2, 4))
    assert reply.is_ok, reply.reason
    assert reply.tp == wire.WorkerTP(1, (wire.WorkerRank(0, 0, 4, ENDPOINT),))
    peer = d.hub.peers[b"rank-1"]
    assert (peer.tp_rank, peer.tp_size) == (1, 2)
    assert peer.head_slice == HeadSlice(0, 1, 2, 0, 2, 4, 2)
    assert list(d.hub.ctx.pages.sliced) == [(2, 2)]  # our token runs of heads 2..3
    d.register(b"rank-1b", 2, wire.DecodeRank(1, 2, 2, 4))
    assert list(d.hub.ctx.pages.sliced) == [(2, 2)]  # prepared once


def test_a_replica_holding_every_head_it_needs_whole_copies_pages(d: Desk) -> None:
    one_head = KVLayout(2, 1, 8, "float32", 4, 16)
    d.desk._layout = one_head  # a 1-head model: a TP-2 decode replicates it
    reply = d.register(b"rank-0", 1, wire.DecodeRank(0, 2, 0, 1))
    assert reply.is_ok, reply.reason
    assert d.hub.peers[b"rank-0"].head_slice is None and not d.hub.ctx.pages.sliced


@pytest.mark.parametrize(
    ("num_heads", "tp", "why"),
    [
        (2, wire.DecodeRank(1, 2, 0, 2), "the rule gives [2, 4)"),
        (1, wire.DecodeRank(0, 3, 0, 1), "do not split over 3"),
        (2, wire.DecodeRank(2, 2, 0, 2), "not a rank"),
        (4, wire.DecodeRank(0, 2, 0, 2), "KV"),  # its pool holds every head: not a TP-2 rank
    ],
)
def test_a_rank_off_the_rule_is_refused(d: Desk, num_heads: int, tp: Any, why: str) -> None:
    reply = d.register(b"bad", num_heads, tp)
    assert not reply.is_ok and why in reply.reason, reply.reason
    assert b"bad" not in d.hub.peers and "bad" not in d.agent.added


def test_a_decode_naming_no_rank_gets_v1s_answer(d: Desk) -> None:
    reply = d.register(b"v1", 4)
    assert reply.is_ok and reply.tp is msgspec.UNSET
    assert d.hub.peers[b"v1"].head_slice is None and d.hub.peers[b"v1"].is_fed
    assert b"tp" not in wire.encode(reply)


def test_a_refused_rank_hears_why_and_its_named_rooms_fail() -> None:
    d = Desk()
    d.register(b"bad", 2, wire.DecodeRank(1, 2, 0, 2))
    assert d.server.sent[-1][0] == b"bad"  # the refusal goes to the registering connection
    sender = d.hub.create_sender(9, "req-9", 16, allowed_peer="bad")
    assert sender.poll() is KVPoll.FAILED  # the router named it: it will never claim
    assert "registration refused" in (sender.failure_reason() or "")


class Leader:
    """The native desk of rank 0 of a TP-2 worker over a 4-head model: its pool holds heads
    0..1 (``lead``)."""

    LOCAL = KVLayout(2, 2, 8, "float32", 4, 16)

    def __init__(self) -> None:
        self.d = Desk()
        regions = KVRegions(self.LOCAL, (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 5 << 20, 8)
        described = msgspec.structs.replace(
            DESCRIBED, layout=wire.Layout.of(self.LOCAL), compat_hash=self.LOCAL.compat_hash()
        )
        self.d.desk = BootstrapDesk(
            self.d.hub,
            self.d.server,  # type: ignore[arg-type]
            self.d.agent,
            self.LOCAL,
            BootstrapLimits(),
            described,
            regions=regions,
        )
        self.d.desk.lead(RankPlace(0, 2, 4))


def test_a_leader_describes_the_model_and_its_worker_layout() -> None:
    d = Leader().d
    d.desk.dispatch(b"who", wire.Describe())
    described = d.server.sent[-1][1]
    assert described.layout == wire.Layout.of(OURS)  # every head, not the leader's two
    assert described.compat_hash == OURS.compat_hash()
    assert (described.agent_name, described.peer_timeout_s) == ("prefill-0", 9.0)
    reply = d.register(b"rank-1", 2, wire.DecodeRank(1, 2, 2, 4))
    assert reply.is_ok, reply.reason
    assert reply.tp == wire.WorkerTP(
        2, (wire.WorkerRank(0, 0, 2, ENDPOINT), wire.WorkerRank(1, 2, 4, ENDPOINT))
    )


def test_a_leader_writes_a_tp1_decode_its_heads_as_token_runs() -> None:
    d = Leader().d
    reply = d.register(b"whole", 4)  # names no rank: a TP-1 decode of the whole model
    assert reply.is_ok and reply.tp is msgspec.UNSET, reply.reason
    peer = d.hub.peers[b"whole"]
    assert peer.head_slice == HeadSlice(0, 0, 0, 0, 2, 2, 4)
    assert peer.is_fed and peer.registration is not None
    assert d.hub.ctx.pages.sliced[(0, 2)] is not None  # our runs of heads 0..1, prepared
    assert d.agent.prepped[-2:] == ["whole", "whole"]  # its kv and aux lists, by its name


def test_a_leader_binds_a_decode_rank_it_feeds_nothing() -> None:
    d = Leader().d
    reply = d.register(b"rank-1", 2, wire.DecodeRank(1, 2, 2, 4))  # heads 2..3: rank 1's
    assert reply.is_ok, reply.reason
    peer = d.hub.peers[b"rank-1"]
    assert not peer.is_fed and peer.head_slice is None  # the aux row and status only
    assert (peer.tp_rank, peer.tp_size) == (1, 2)
    reply = d.register(b"rank-0", 2, wire.DecodeRank(0, 2, 0, 2))
    assert reply.is_ok and d.hub.peers[b"rank-0"].is_fed
    assert d.hub.peers[b"rank-0"].head_slice is None  # p = d: whole pages
    assert not d.hub.ctx.pages.sliced
