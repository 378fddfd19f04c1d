"""What each SGLang control message does to the tables, with a stand-in NIXL agent: a
registration becomes a peer (once), a restarted decode replaces its old record once that is
idle (a live one keeps its address), a request is a want that waits for its room or binds it
and may name only its own agent, an ABORT acts only for the room's owner, and a frame whose
ip is not its connection's is dropped."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import json
from pathlib import Path
from typing import Any

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer.nixl.poster import InlinePoster
from prefill_worker.transfer.nixl.state_lists import StateLists
from prefill_worker.transfer.push.dialect import PageLists
from prefill_worker.transfer.push.hub import PushHub
from prefill_worker.transfer.push.refusals import ExpiringTable, Refusals, RejectCounter
from prefill_worker.transfer.push.sender import PushContext
from prefill_worker.transfer.sglang.components import StateComponents
from prefill_worker.transfer.sglang.desk import SglangDesk
from prefill_worker.transfer.sglang.dialect import SglangDialect, SglangPeer
from prefill_worker.transfer.sglang.frames import (
    AbortNotice,
    Endpoint,
    Message,
    Registration,
    TransferRequest,
    parse,
)
from prefill_worker.transfer.slot_stage import StagedState
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import BootstrapLimits

CAPTURED = json.loads((Path(__file__).parent / "sglang_frames.json").read_text())
LAYOUT = KVLayout(2, 2, 16, "float32", 4, 64)


class FakeList:
    def release(self) -> None:
        return None


class FakeAgent:
    """What the desk asks of NIXL: remote agents by the name their metadata carries."""

    def __init__(self) -> None:
        self.remote: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> str:
        name = metadata[24 : 24 + int.from_bytes(metadata[16:24], "little")].decode()
        self.remote.append(name)
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.remote.remove(name)

    def prep_xfer_dlist(self, name: str, table: Any, mem_type: str) -> FakeList:
        return FakeList()


class FakeReplies:
    def __init__(self) -> None:
        self.sent: list[tuple[Endpoint, list[bytes]]] = []

    def send(self, endpoint: Endpoint, frames: list[bytes]) -> bool:
        self.sent.append((endpoint, frames))
        return True


def frames_of(kind: str) -> list[bytes]:
    return [base64.b64decode(f) for f in CAPTURED["0.5.23"][kind]]


def registration(name: str | None = None) -> Registration:
    frames = frames_of("registration")
    if name is not None:  # the same decode under another agent name (a restart)
        metadata, head = frames[5], b"nixlSerDes|Agent"
        rest = metadata[24 + int.from_bytes(metadata[16:24], "little") :]  # from its "|"
        frames[4] = name.encode()
        frames[5] = head + len(name).to_bytes(8, "little") + name.encode() + rest
    reg = parse(frames)
    assert isinstance(reg, Registration)
    return reg


class RecordingHub(PushHub[SglangPeer]):
    def __init__(self, ctx: PushContext[SglangPeer], agent: FakeAgent) -> None:
        self.rejects: list[str] = []
        self.dropped: list[tuple[str, str]] = []
        counter = RejectCounter("sglang", self.rejects.append)
        refusals = Refusals(ExpiringTable(0.0, 1), ExpiringTable(5.0, 1024))
        super().__init__(ctx, agent, counter, refusals, 5.0, 64)

    def drop_peer(self, peer: SglangPeer, reason: str) -> None:
        self.dropped.append((peer.agent_name, reason))
        super().drop_peer(peer, reason)


def draft_pool(layout: KVLayout, num_layers: int) -> KVRegions:
    """A draft's pool of ``num_layers`` layers of ``layout``'s pages (MLA: latents only)."""
    lay = dataclasses.replace(layout, num_layers=num_layers)
    k = tuple((1 + i) << 40 for i in range(num_layers))
    v = () if lay.kind == "mla" else tuple((9 + i) << 40 for i in range(num_layers))
    return KVRegions(lay, k, v, "cpu", 0, 1)


class Rig:
    """The desk over a real hub; NIXL and the reply sockets stand-ins."""

    def __init__(
        self,
        allowed_networks: tuple[str, ...] = (),
        is_rejoining: bool = False,
        regions: KVRegions | None = None,  # ours: a desk that slices heads prepares them
        layout: KVLayout = LAYOUT,  # the worker's pool
        sliding: SlidingLayers | None = None,  # a sliding-window model's layers
        agent: FakeAgent | None = None,
        num_draft_layers: int = 0,  # the worker's draft's
        dsa: StateRegions | None = None,  # a DSA model's FP8 index pages
        mamba: StagedState | None = None,  # a hybrid linear-attention model's staged state
        state: StateLists | None = None,  # the worker's state pool, as the hub sends it
    ) -> None:
        self.agent, self.replies = agent or FakeAgent(), FakeReplies()
        self.now = 0.0
        poster = InlinePoster(self.agent)
        dialect = SglangDialect(self.replies, poster, None, None)  # type: ignore[arg-type]
        pages = PageLists(None, layout.num_regions, layout.page_bytes)
        if dsa is not None:
            state = StateLists(dsa, FakeList())
        ctx = PushContext(poster, pages, layout, dialect, 5.0, lambda: self.now, state=state)
        self.hub = RecordingHub(ctx, self.agent)
        self.rejects, self.dropped = self.hub.rejects, self.hub.dropped
        self.rooms = self.hub.rooms
        self.desk = SglangDesk(
            self.hub,
            self.agent,
            self.replies,  # type: ignore[arg-type]
            layout,
            BootstrapLimits(),
            is_rejoining=lambda: is_rejoining,
            allowed_networks=[ipaddress.ip_network(n) for n in allowed_networks],
            regions=regions,
            draft=draft_pool(layout, num_draft_layers) if num_draft_layers else None,
            components=StateComponents(
                self.agent, BootstrapLimits(), sliding=sliding, dsa=dsa, mamba=mamba
            ),
        )

    @property
    def peers(self) -> dict[str, SglangPeer]:
        return {identity.decode(): peer for identity, peer in self.hub.peers.items()}

    def send(self, message: Message, source_ip: str | None = None) -> None:
        """As the control socket hands it over: from the ip it names unless told otherwise."""
        self.desk.dispatch(message, source_ip or message.endpoint.host)


def test_a_registration_is_one_peer() -> None:
    rig = Rig()
    reg = registration()
    rig.send(reg)
    rig.send(reg)  # SGLang registers once; a repeat changes nothing
    assert list(rig.peers) == [reg.agent_name] == rig.agent.remote
    assert rig.peers[reg.agent_name].endpoint == reg.endpoint


def test_a_live_decode_keeps_its_address_and_an_idle_one_is_replaced() -> None:
    rig = Rig()
    rig.send(registration())
    old = next(iter(rig.peers))
    request = parse(frames_of("request"))
    assert isinstance(request, TransferRequest)
    rig.send(request)  # waits for its room's request
    rig.now += 60.0  # silent for long, but it has a request waiting: live
    rig.send(registration("impostor"))
    assert list(rig.peers) == [old] and rig.rooms.num_claims(1234) == 1
    assert rig.rejects[-1] == "address_taken" and not rig.dropped
    rig.rooms.drop(1234, rig.peers[old])
    rig.now += 1.0  # nothing waiting, but heard from within want_timeout_s: live
    rig.peers[old].last_seen = rig.now
    rig.send(registration("impostor"))
    assert list(rig.peers) == [old] and rig.rejects[-1] == "address_taken"
    rig.now += 5.0  # idle: a decode restarted on the same port takes it
    rig.send(registration("restarted-decode"))
    assert rig.dropped == [(old, "decode re-registered under a new agent name")]
    assert list(rig.peers) == ["restarted-decode"]


def test_a_request_may_name_only_its_own_agent() -> None:
    rig = Rig()
    reg = registration()
    rig.send(reg)
    request = parse(frames_of("request"))
    assert isinstance(request, TransferRequest)
    elsewhere = Endpoint(reg.endpoint.host, reg.endpoint.port + 1)
    rig.send(dataclasses.replace(request, endpoint=elsewhere))
    assert rig.rooms.num_claims(request.room) == 0 and rig.rejects == ["foreign_agent"]
    assert rig.replies.sent[-1][0] == elsewhere  # the refusal goes to the sender itself


def test_a_frame_whose_ip_is_not_its_connections_is_dropped() -> None:
    rig = Rig()
    reg = registration()
    rig.send(reg, source_ip="10.9.9.9")
    rig.send(dataclasses.replace(reg, endpoint=Endpoint("decode.example", 1)), "10.9.9.9")
    assert not rig.peers and rig.rejects == ["spoofed_address"] * 2 and not rig.replies.sent
    rig.send(reg, source_ip=f"::ffff:{reg.endpoint.host}")  # IPv4 over an IPv6 socket
    assert list(rig.peers) == [reg.agent_name]


def test_the_allow_list_admits_only_its_networks() -> None:
    reg = registration()
    for networks, is_admitted in (("10.0.0.0/8",), False), ((f"{reg.endpoint.host}/32",), True):
        rig = Rig(networks)
        rig.send(reg)
        assert bool(rig.peers) is is_admitted, networks
        assert rig.rejects == ([] if is_admitted else ["network_not_allowed"])


def test_an_abort_acts_only_for_the_rooms_owner() -> None:
    rig = Rig()
    reg = registration()
    rig.send(reg)
    request = parse(frames_of("request"))
    assert isinstance(request, TransferRequest)
    rig.send(request)
    stranger = AbortNotice(1234, Endpoint("127.0.0.1", 1), generation=3)
    rig.send(stranger)
    assert rig.rooms.num_claims(1234) == 1  # untouched, but acknowledged
    assert rig.replies.sent[-1] == (stranger.endpoint, [b"ABORT_ACK", b"1234", b"0", b"3"])
    rig.send(dataclasses.replace(stranger, endpoint=reg.endpoint))
    assert rig.rooms.num_claims(1234) == 0
    assert rig.rooms.take_aborted(1234) == reg.agent_name  # its request will end at once


def test_an_unknown_decode_hears_nothing_in_the_rejoin_window() -> None:
    """A decode that knew the previous run: no ``KV_STATUS failed`` while the window is open
    (its heartbeat drops that run); after the window it is told it is not registered."""
    request = parse(frames_of("request"))
    assert isinstance(request, TransferRequest)
    rejoining = Rig(is_rejoining=True)
    rejoining.send(request)
    assert rejoining.replies.sent == [] and rejoining.rooms.num_claims(request.room) == 0
    assert rejoining.hub.counter.counts == {"unknown_peer": 1}
    after = Rig()
    after.send(request)
    assert [frames[:3] for _, frames in after.replies.sent] == [
        [b"KV_STATUS", str(request.room).encode(), b"0"]
    ]
