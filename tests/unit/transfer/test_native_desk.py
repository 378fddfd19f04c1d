"""The native bootstrap desk on a scripted NIXL agent and server (no sockets): a registration
is checked before any peer is touched, every refusal is counted and answered with its reason,
an unregistered connection touches no room, and a message that raises refuses only its peer."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.validate import BootstrapLimits
from tests.unit.transfer.test_push_sender import LAYOUT, FakeList, Rig

DESCRIBED = wire.Described(
    agent_name="prefill-0",
    layout=wire.Layout.of(LAYOUT),
    compat_hash=LAYOUT.compat_hash(),
    peer_timeout_s=9.0,
    heartbeat_interval_s=3.0,
)
REGIONS = KVRegions(LAYOUT, (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 5 << 20, 8)


class Server:
    """What the desk sends, by connection; ``dead`` connections cannot be reached."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []
        self.dead: set[bytes] = set()

    def send(self, identity: bytes, msg: Any) -> bool:
        self.sent.append((identity, msg))
        return identity not in self.dead


class Agent:
    """NIXL's remote-agent calls: the metadata payload is the agent's name."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.prepped: list[str] = []
        self.removed: list[str] = []
        self.refuse_add = self.refuse_prep = False

    def add_remote_agent(self, metadata: bytes) -> bytes:
        if self.refuse_add:
            raise NIXL_ERRORS[0]("bad blob")
        self.added.append(metadata.decode())
        return metadata

    def prep_xfer_dlist(self, name: str, table: Any, mem_type: str) -> FakeList:
        if self.refuse_prep:
            raise NIXL_ERRORS[0]("no such memory")
        self.prepped.append(name)
        return FakeList()

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)


class Desk:
    def __init__(self) -> None:
        self.rig = Rig("native")
        self.hub = self.rig.hub
        del self.hub.peers[self.rig.peer.identity]  # the desk admits its own
        self.server, self.agent = Server(), Agent()
        self.desk = BootstrapDesk(
            self.hub,
            self.server,  # type: ignore[arg-type]
            self.agent,
            LAYOUT,
            BootstrapLimits(),
            DESCRIBED,
        )

    def register(self, identity: bytes, name: str = "decode-1", **changes: Any) -> Any:
        msg = wire.Register.of(
            name, wire.frame_metadata(name.encode()), REGIONS, DESCRIBED.compat_hash
        )
        self.desk.dispatch(identity, msgspec.structs.replace(msg, **changes))
        return self.server.sent[-1][1]


def registered(reason: str | None) -> wire.Registered:
    return wire.Registered(
        is_ok=reason is None,
        reason=reason,
        agent_name="prefill-0",
        heartbeat_interval_s=3.0,
        peer_timeout_s=9.0,
    )


@pytest.fixture
def d() -> Desk:
    return Desk()


def test_a_registration_adds_one_peer_and_clears_its_refusal(d: Desk) -> None:
    d.hub.refusals.names.add("decode-1", "earlier", d.rig.now)
    assert d.register(b"c1") == registered(None)
    peer = d.hub.peers[b"c1"]
    assert (peer.agent_name, peer.regions, peer.last_seen) == ("decode-1", REGIONS, d.rig.now)
    assert d.hub.refusals.names.get("decode-1", d.rig.now) is None
    assert d.agent.added == ["decode-1"] and not d.hub.counter.counts


def test_a_bad_registration_is_refused_and_fails_the_rooms_named_for_it(d: Desk) -> None:
    waiting = d.hub.create_sender(7, "req-7", 16, allowed_peer="decode-1")
    other = d.hub.create_sender(8, "req-8", 16, allowed_peer="decode-2")
    answer = d.register(b"c1", compat_hash="0" * 16)
    assert not answer.is_ok and answer.reason and not d.hub.peers and not d.agent.added
    assert answer == registered(answer.reason)
    assert d.hub.counter.counts == {"layout_mismatch": 1}
    assert d.hub.refusals.names.get("decode-1", d.rig.now) == answer.reason
    assert waiting.failure_reason() == f"registration refused: {answer.reason}"
    assert other.poll() is KVPoll.BOOTSTRAPPING


def test_a_name_a_live_connection_holds_is_refused_without_blaming_the_name(d: Desk) -> None:
    d.register(b"c1")
    waiting = d.hub.create_sender(7, "req-7", 16, allowed_peer="decode-1")
    answer = d.register(b"c2")
    assert answer == registered("agent name 'decode-1' is registered by another live connection")
    assert d.server.sent[-2] == (b"c1", wire.Heartbeat())  # the holder was asked
    assert d.server.sent[-1][0] == b"c2"
    assert d.hub.counter.counts == {"name_taken": 1} and list(d.hub.peers) == [b"c1"]
    assert len(d.hub.refusals.names) == 0  # no name blamed
    d.register(b"c1", compat_hash="0" * 16)  # the live holder's bad repeat blames no name
    assert len(d.hub.refusals.names) == 0
    assert waiting.poll() is KVPoll.BOOTSTRAPPING


def test_a_name_whose_holder_is_gone_or_a_connection_registering_again_replaces_it(
    d: Desk,
) -> None:
    d.register(b"c1")
    d.server.dead.add(b"c1")
    assert d.register(b"c2") == registered(None)
    assert list(d.hub.peers) == [b"c2"] and d.rig.agent.forgotten == ["decode-1"]
    first = d.hub.peers[b"c2"]
    assert d.register(b"c2") == registered(None)  # again, same connection
    assert d.hub.peers[b"c2"] is not first and len(d.hub.peers) == 1
    assert d.rig.agent.forgotten == ["decode-1"] * 2


def test_nixl_refusing_the_agent_or_its_pool_is_a_refusal(d: Desk) -> None:
    d.agent.refuse_add = True
    assert d.register(b"c1") == registered("NIXL refused: bad blob")
    d.agent.refuse_add, d.agent.refuse_prep = False, True
    assert d.register(b"c1") == registered("NIXL cannot address the decode pool: no such memory")
    assert d.agent.removed == ["decode-1"] and not d.hub.peers
    assert d.hub.counter.counts == {"nixl_refused": 2}
    assert d.hub.refusals.names.get("decode-1", d.rig.now) is not None


def test_metadata_naming_another_agent_is_refused_and_that_agent_forgotten(d: Desk) -> None:
    frame = wire.frame_metadata(b"impostor")
    answer = d.register(b"c1", metadata=frame)
    assert answer == registered("metadata names agent 'impostor', not 'decode-1'")
    assert d.agent.removed == ["impostor"] and d.hub.counter.counts == {"bad_metadata": 1}
    d.register(b"c9", name="impostor")  # a live peer of that name is left alone
    d.register(b"c1", metadata=frame)
    assert d.agent.removed == ["impostor"] and b"c9" in d.hub.peers


def test_the_messages_of_a_connection(d: Desk) -> None:
    d.desk.dispatch(b"c1", wire.Describe())
    assert d.server.sent[-1] == (b"c1", DESCRIBED)
    d.desk.dispatch(b"c1", wire.WireError("garbled"))
    assert d.server.sent[-1] == (b"c1", wire.Reject("garbled"))
    assert d.hub.counter.counts == {"bad_message": 1}


def test_an_unregistered_connection_touches_no_room(d: Desk) -> None:
    sender = d.hub.create_sender(7, "req-7", 16)
    d.desk.dispatch(b"c1", wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    d.desk.dispatch(b"c1", wire.Abort(7))
    d.desk.dispatch(b"c1", wire.Heartbeat())
    unknown = "decode peer not registered"
    assert d.server.sent == [
        (b"c1", wire.Status(7, "failed", unknown, "unknown_peer")),
        (b"c1", wire.Status(7, "aborted", "aborted by decode")),
        (b"c1", wire.UnknownPeer(unknown)),
    ]
    assert sender.poll() is KVPoll.BOOTSTRAPPING and d.hub.counter.counts == {"unknown_peer": 1}


def test_a_peers_wants_aborts_and_bye_go_to_the_hub(d: Desk) -> None:
    d.register(b"c1")
    peer = d.hub.peers[b"c1"]
    d.rig.now += 1.0
    d.desk.dispatch(b"c1", wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    assert peer.last_seen == d.rig.now and d.hub.rooms.num_claims(7) == 1
    d.desk.dispatch(b"c1", wire.Want.of(8, range(10_000), 2, 0))  # more than any prompt
    assert d.hub.counter.counts == {"bad_want": 1} and d.hub.rooms.num_claims(8) == 0
    d.desk.dispatch(b"c1", wire.Abort(7))
    assert d.hub.rooms.num_claims(7) == 0
    assert [s[:2] for s in d.rig.heard.said] == [(8, "failed"), (7, "aborted")]
    d.desk.dispatch(b"c1", wire.Bye())
    assert not d.hub.peers and "decode-1" in d.rig.agent.forgotten


def test_a_message_that_raises_refuses_only_its_peer(d: Desk) -> None:
    d.register(b"c1")
    d.register(b"c2", name="decode-2")

    def boom(*args: Any) -> None:
        raise RuntimeError("x" * 400)

    d.hub.want = boom  # type: ignore[method-assign,assignment]
    d.desk.dispatch(b"c1", wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    reason = f"internal error on a bootstrap message: {RuntimeError('x' * 400)!r}"[:300]
    assert d.server.sent[-1] == (b"c1", wire.Reject(reason))
    assert list(d.hub.peers) == [b"c2"] and d.hub.counter.counts == {"internal_error": 1}
    d.desk.dispatch(b"c3", wire.Register.of("x", b"", REGIONS, "h"))  # no peer: answered
    assert d.server.sent[-1][0] == b"c3"


def bound(d: Desk, identity: bytes, room: int = 7) -> Any:
    sender = d.hub.create_sender(room, f"req-{room}", 16)
    d.desk.dispatch(identity, wire.Want.of(room, [3, 4, 5, 6], 2, 0))
    assert sender.poll() is KVPoll.READY
    return sender


@pytest.mark.parametrize(
    ("how", "reason"),
    [("bye", "decode peer left"), ("again", "decode peer registered again")],
)
def test_a_peer_dropped_fails_its_rooms_with_why(d: Desk, how: str, reason: str) -> None:
    d.register(b"c1")
    sender = bound(d, b"c1")
    if how == "bye":
        d.desk.dispatch(b"c1", wire.Bye())
    else:
        d.register(b"c1")
    assert sender.failure_reason() == reason


def test_a_reconnected_name_fails_the_old_connections_rooms(d: Desk) -> None:
    d.register(b"c1")
    sender = bound(d, b"c1")
    d.server.dead.add(b"c1")
    d.register(b"c2")
    assert sender.failure_reason() == "decode peer reconnected"
    assert d.server.sent[-1] == (b"c2", registered(None))


def test_a_message_that_raises_fails_its_peers_rooms_with_the_error(d: Desk) -> None:
    d.register(b"c1")
    sender = bound(d, b"c1")

    def boom(*args: Any) -> None:
        raise RuntimeError("boom")

    d.hub.abort = boom  # type: ignore[method-assign,assignment]
    d.desk.dispatch(b"c1", wire.Abort(7))
    assert sender.failure_reason() == "internal error on a bootstrap message: RuntimeError('boom')"


@pytest.mark.parametrize("failure", ["add", "prep", "metadata"])
def test_every_nixl_refusal_is_remembered_by_name_while_other_peers_live(
    d: Desk, failure: str
) -> None:
    d.register(b"c2", name="decode-2")
    d.agent.refuse_add, d.agent.refuse_prep = failure == "add", failure == "prep"
    frame = wire.frame_metadata(b"impostor" if failure == "metadata" else b"decode-1")
    answer = d.register(b"c1", metadata=frame)
    assert d.server.sent[-1] == (b"c1", answer) and not answer.is_ok
    assert d.hub.refusals.names.get("decode-1", d.rig.now) == answer.reason


def test_an_agent_name_nixl_gives_as_text_is_taken_too(d: Desk) -> None:
    d.agent.add_remote_agent = lambda metadata: metadata.decode()  # type: ignore[method-assign,assignment,return-value]
    assert d.register(b"c1") == registered(None)
    assert d.hub.peers[b"c1"].agent_name == "decode-1" and d.agent.prepped == ["decode-1"] * 2


def test_each_outcome_is_logged_at_its_level(d: Desk, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        d.register(b"c1")
        d.register(b"c2", compat_hash="0" * 16)
        d.desk.dispatch(b"c3", wire.Heartbeat())
        d.desk.dispatch(b"c3", wire.Want.of(7, [3], 2, 0))
        d.desk.dispatch(b"c3", wire.WireError("garbled"))
    said = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name.startswith("prefill_worker.transfer")
    ]
    refused = d.server.sent[1][1].reason
    assert said == [
        (logging.INFO, "bootstrap: decode peer decode-1 registered"),
        (logging.WARNING, f"test: layout_mismatch: registration refused: {refused}"),
        (logging.DEBUG, "test: unknown_peer: decode peer not registered"),
        (logging.WARNING, "test: bad_message: bad message from a peer: garbled"),
    ]
    assert [identity for identity, _ in d.server.sent] == [b"c1", b"c2", b"c3", b"c3", b"c3"]


def test_an_error_is_logged_as_one(d: Desk, caplog: pytest.LogCaptureFixture) -> None:
    def boom(*args: Any) -> None:
        raise RuntimeError("boom")

    d.register(b"c1")
    d.hub.want = boom  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.DEBUG, logger="prefill_worker.transfer.push.refusals"):
        d.desk.dispatch(b"c1", wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR,
        "test: internal_error: internal error on a bootstrap message: RuntimeError('boom')",
    )
