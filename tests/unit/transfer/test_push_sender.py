"""The push engine (one sender, its hub) once per dialect, native and SGLang, against a
scripted NIXL agent: no SGLang install, no sockets. A sender never calls back (what the hub
must do comes out as events), ``close()`` never waits, ``written_bytes`` counts what landed,
and no status reaches a decode while a write of its room may still land."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxPool, AuxRow
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.native.dialect import NativeDialect
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, PreppedLists
from prefill_worker.transfer.nixl.poster import InlinePoster
from prefill_worker.transfer.push.dialect import PageLists
from prefill_worker.transfer.push.hub import PushHub
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.refusals import (
    ExpiringTable,
    Refusals,
    RefusedRoom,
    RejectCounter,
)
from prefill_worker.transfer.push.sender import Closed, PushContext, PushSender, Tell
from prefill_worker.transfer.sglang import aux, frames
from prefill_worker.transfer.sglang.dialect import SglangDialect, SglangPeer

LAYOUT = KVLayout(2, 1, 8, "float32", 4, 16)  # page_bytes = 4 * 1 * 8 * 4 = 128
REGIONS = KVRegions(LAYOUT, (4096, 8192), (12288, 16384), "cpu", 20480, 4)
PAGE_RUN_BYTES = 2 * 2 * 128  # one page: (K, V) x 2 layers


class Handle:
    def __init__(self, refuse_release: bool, args: tuple[Any, ...]) -> None:
        self.state, self.refuse_release, self.is_released = "PROC", refuse_release, False
        self.args = args

    def release(self) -> None:
        if self.refuse_release:
            raise NIXL_ERRORS[0]("cannot cancel")
        self.is_released = True


class Agent:
    """What the poster asks of NIXL; every write stays PROC until the test says."""

    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.refuse_release = False
        self.forgotten: list[str] = []

    def make_prepped_xfer(self, *args: Any) -> Handle:
        self.handles.append(Handle(self.refuse_release, args))
        return self.handles[-1]

    def get_xfer_descs(self, descs: np.ndarray, mem_type: str) -> np.ndarray:
        return descs

    def initialize_xfer(self, *args: Any) -> Handle:
        return self.make_prepped_xfer(*args)

    def transfer(self, handle: Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: Handle) -> str:
        return handle.state

    def remove_remote_agent(self, name: str) -> None:
        self.forgotten.append(name)


class FakeList:
    def release(self) -> None:
        return None


@dataclass
class Heard:
    """What the decode heard, whatever the dialect: (room, code, reason, generation)."""

    said: list[tuple[int, str, str | None, int | None]] = field(default_factory=list)

    def native(self, identity: bytes, msg: wire.Status) -> bool:
        self.said.append((msg.room, msg.status, msg.reason, None))
        return True

    def sglang(self, endpoint: frames.Endpoint, message: list[bytes]) -> bool:
        room = int(message[1])
        if message[0] == frames.ABORT_ACK_TAG:
            generation = int(message[3]) if len(message) > 3 else None
            self.said.append((room, "aborted", "aborted by decode", generation))
        else:
            code = "ok" if int(message[2]) == frames.KV_SUCCESS else "failed"
            self.said.append((room, code, message[4].decode() or None, None))
        return True


class Sink:
    def __init__(self, send: Any) -> None:
        self.send = send


class Rig:
    """A hub and one peer on one dialect; ``aux_bytes`` is what its aux WRITE carries."""

    def __init__(self, dialect_name: str) -> None:
        self.agent, self.heard, self.now = Agent(), Heard(), 100.0
        self.refusals = Refusals(ExpiringTable(60.0, 8), ExpiringTable(5.0, 8))
        poster = InlinePoster(self.agent)
        lists = PreppedLists(FakeList(), FakeList())
        self.peer: Peer
        if dialect_name == "native":
            server = Sink(self.heard.native)
            dialect: Any = NativeDialect(server, poster, "aux", self.refusals.names, self.clock)  # type: ignore[arg-type]
            self.peer = Peer(b"decode-1", "decode-1", REGIONS, lists, self.now)
            self.aux_bytes = AUX_ROW_BYTES
        else:
            self.pool = AuxPool(4)
            self.pool.buffer[1] = np.frombuffer(AuxRow(42, -0.5, 16, 0).pack(), np.uint8)
            rows = aux.AuxRowsView(self.pool.base_addr, 4)
            self.staging = aux.AuxStaging(4)
            replies = Sink(self.heard.sglang)
            dialect = SglangDialect(replies, poster, self.staging, rows)  # type: ignore[arg-type]
            endpoint = frames.Endpoint("127.0.0.1", 5555)
            aux_ptrs = tuple(range(0x10000, 0x1A000, 0x1000))
            self.peer = SglangPeer(
                b"decode-1",
                "decode-1",
                REGIONS,
                lists,
                self.now,
                aux_ptrs=aux_ptrs,
                endpoint=endpoint,
            )
            self.aux_bytes = aux.ROW_DTYPE.itemsize
        pages = PageLists("kv", LAYOUT.num_regions, LAYOUT.region_page_bytes)
        ctx: PushContext[Any] = PushContext(poster, pages, LAYOUT, dialect, 5.0, self.clock)
        self.ctx = ctx
        self.hub: PushHub[Any] = PushHub(
            ctx, self.agent, RejectCounter("test"), self.refusals, 5.0, 64
        )
        self.hub.peers[self.peer.identity] = self.peer

    def clock(self) -> float:
        return self.now

    def bound_sender(self, room: int = 7) -> PushSender[Any]:
        sender = self.hub.create_sender(room, f"req-{room}", 16)
        self.hub.want(self.peer, wire.Want.of(room, [3, 4, 5, 6], 2, 0))
        assert sender.poll() is KVPoll.READY and not self.ctx.events
        return sender

    def land(self, index: int) -> None:
        self.agent.handles[index].state = "DONE"


@pytest.fixture(params=["native", "sglang"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(request.param)


def test_a_chunked_push_ends_in_ok_and_counts_what_landed(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)  # the first chunk
    sender.send_pages([2, 3], 2)  # the second
    sender.send_aux(1)
    sender.progress()
    assert len(rig.agent.handles) == 2 and sender.needs_progress  # no aux while pages fly
    assert sender.transfer_stats().bytes == 0  # nothing landed yet
    rig.land(0)
    rig.land(1)
    sender.progress()  # the pages landed: the aux row is posted
    assert sender.transfer_stats().bytes == 4 * PAGE_RUN_BYTES and len(rig.agent.handles) == 3
    rig.land(2)
    sender.progress()
    [tell] = rig.ctx.events
    assert isinstance(tell, Tell) and tell.status.status == "ok" and tell.confirm is sender
    assert sender.poll() is KVPoll.TRANSFERRING and not sender.needs_progress
    rig.hub.drain()
    assert rig.heard.said == [(7, "ok", None, None)]
    assert sender.poll() is KVPoll.SUCCESS
    assert sender.transfer_stats().bytes == 4 * PAGE_RUN_BYTES + rig.aux_bytes


def test_each_chunk_writes_its_pages_into_the_pages_the_decode_named(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([9, 8], 0)
    sender.send_pages([7], 2)
    first, second = rig.agent.handles
    _, local, local_idx, _, remote_idx, notif = first.args
    assert (local, notif) == ("kv", b"")
    assert list(local_idx[:2]) == [9, 8] and list(remote_idx[:2]) == [3, 4]
    assert len(local_idx) == 2 * LAYOUT.num_regions  # every region of each page
    assert list(second.args[4][:1]) == [5]


def test_the_aux_row_goes_to_the_slot_the_decode_named(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_aux(1)
    sender.progress()
    [handle] = rig.agent.handles
    if isinstance(rig.peer, SglangPeer):  # SGLang's format, into row 2 of each buffer
        _, local, remote, name = handle.args
        assert name == "decode-1" and len(local) == len(remote) == aux.NUM_AUX_BUFFERS
        rows = zip(rig.peer.aux_ptrs, aux.ITEM_BYTES, strict=True)
        assert list(remote[:, 0]) == [ptr + 2 * num_bytes for ptr, num_bytes in rows]
        staged = rig.staging.rows[1]
        assert staged["output_ids"][0] == 42 and staged["bootstrap_room"][0] == 7
    else:  # one row between the prepared aux lists, with the room's notification
        _, local, local_idx, remote, remote_idx, notif = handle.args
        assert (local, list(local_idx), list(remote_idx)) == ("aux", [1], [2])
        assert notif == wire.notif_tag(7)


def test_an_undelivered_ok_fails_the_request(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0, 1, 2, 3], 0)
    sender.send_aux(1)
    for handle_index in (0, 1):
        sender.progress()
        rig.land(handle_index)
    sender.progress()
    rig.ctx.events.clear()
    sender.confirm_ok(False)
    assert sender.poll() is KVPoll.FAILED
    assert "unreachable" in (sender.failure_reason() or "")


def test_close_with_a_write_in_flight_cancels_it_without_waiting(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)
    sender.close()
    assert rig.agent.handles[0].is_released and sender.num_inflight == 0
    tell, closed = rig.ctx.events
    assert isinstance(tell, Tell) and tell.peer is rig.peer
    assert tell.status.status == "failed"
    assert closed == Closed(sender, ())
    assert sender.transfer_stats().bytes == 0  # cancelled, never landed
    rig.hub.drain()
    assert rig.heard.said == [(7, "failed", "the request ended before its transfer", None)]
    assert not rig.hub.senders and not rig.peer.rooms


def test_a_handle_nixl_will_not_release_goes_to_the_reaper(rig: Rig) -> None:
    rig.agent.refuse_release = True
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)
    sender.close()
    tell, closed = rig.ctx.events
    assert isinstance(closed, Closed) and len(closed.stuck) == 1
    [stuck] = closed.stuck
    assert stuck.is_refused and not stuck.is_settled
    # the `failed` status waits for that write: the decode may reuse the pages once told
    assert isinstance(tell, Tell) and tell.after == (stuck,)
    rig.hub.drain()
    assert rig.heard.said == [] and rig.hub.num_inflight_transfers() == 1
    rig.agent.handles[0].refuse_release = False
    rig.hub.turn(rig.now)  # the reaper retries: released, and the status goes out
    assert rig.agent.handles[0].is_released and rig.hub.num_inflight_transfers() == 0
    assert rig.heard.said == [(7, "failed", "the request ended before its transfer", None)]


def test_a_handle_nixl_keeps_refusing_costs_its_peer(rig: Rig) -> None:
    rig.agent.refuse_release = True
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)
    sender.close()
    rig.hub.turn(rig.now)
    assert rig.hub.peers and rig.hub.num_inflight_transfers() == 1  # retried, not given up
    rig.now += 1.0  # past the reaper's deadline: the peer is dropped, which ends its writes
    rig.hub.turn(rig.now)
    assert not rig.hub.peers and rig.agent.forgotten == ["decode-1"]
    assert rig.hub.num_inflight_transfers() == 0


def test_a_failure_is_held_until_its_writes_settle(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)
    sender.fail("transfer deadline")
    [tell] = rig.ctx.events
    assert isinstance(tell, Tell) and tell.status.status == "failed"
    [write] = tell.after
    assert not write.is_settled  # still copying: the hub holds the status
    rig.hub.drain()
    rig.hub.turn(rig.now)
    assert rig.heard.said == []
    sender.close()
    assert write.is_settled and rig.agent.handles[0].is_released
    rig.hub.turn(rig.now)
    assert rig.heard.said == [(7, "failed", "transfer deadline", None)]


def test_a_failure_before_the_want_is_told_when_it_comes(rig: Rig) -> None:
    sender = rig.hub.create_sender(7, "req-7", 16)
    sender.fail("the engine gave up")
    rig.hub.drain()
    rig.hub.want(rig.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    rig.hub.drain()
    assert rig.heard.said == [(7, "failed", "the engine gave up", None)]


def test_an_abort_after_the_claim_is_acknowledged_once_no_write_flies(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)
    rig.hub.abort(rig.peer, 7, generation=3)
    assert sender.poll() is KVPoll.ABORTED and sender.needs_progress
    assert not rig.ctx.events  # the sender waits for its write before it acknowledges
    rig.hub.turn(rig.now)
    assert rig.heard.said == []  # a write still targets the room's pages
    rig.land(0)
    rig.hub.turn(rig.now)
    generation = 3 if isinstance(rig.peer, SglangPeer) else None  # SGLang echoes it
    assert rig.heard.said == [(7, "aborted", "aborted by decode", generation)]
    sender.send_pages([2, 3], 2)  # the engine has not seen it yet: nothing more is written
    assert len(rig.agent.handles) == 1


def test_an_abort_before_the_request_ends_it_when_it_comes(rig: Rig) -> None:
    rig.hub.want(rig.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    rig.hub.abort(rig.peer, 7)
    assert rig.heard.said == [(7, "aborted", "aborted by decode", None)]
    sender = rig.hub.create_sender(7, "req-7", 16)
    assert sender.poll() is KVPoll.ABORTED
    rig.hub.drain()
    assert len(rig.heard.said) == 1  # acknowledged once, when it came


def test_an_abort_by_another_peer_changes_nothing(rig: Rig) -> None:
    sender = rig.bound_sender()
    other = dataclasses.replace(rig.peer, identity=b"decode-2", agent_name="decode-2", rooms=set())
    rig.hub.abort(other, 7)
    assert sender.poll() is KVPoll.READY  # untouched, but acknowledged
    assert rig.heard.said == [(7, "aborted", "aborted by decode", None)]


def test_losing_the_peer_cancels_its_writes_and_fails_the_request(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0, 1], 0)
    rig.hub.drop_peer(rig.peer, "decode peer silent")
    assert sender.poll() is KVPoll.PEER_LOST and sender.failure_reason() == "decode peer silent"
    assert rig.agent.handles[0].is_released and sender.num_inflight == 0
    assert rig.heard.said == [(7, "failed", "decode peer silent", None)]
    assert rig.agent.forgotten == ["decode-1"] and not rig.hub.peers
    sender.close()
    rig.hub.drain()
    assert len(rig.heard.said) == 1 and not rig.hub.senders
    rig.hub.check_integrity()


def test_a_refused_decode_ends_the_room_it_asked_for_when_its_request_comes(rig: Rig) -> None:
    rig.refusals.rooms.add(7, RefusedRoom("decode-9", "decode not registered"), rig.now)
    other = rig.hub.create_sender(7, "req-7", 16, allowed_peer="decode-1")  # not that decode's
    assert other.poll() is KVPoll.BOOTSTRAPPING
    other.close()
    rig.hub.drain()
    rig.refusals.rooms.add(8, RefusedRoom("decode-9", "decode not registered"), rig.now)
    sender = rig.hub.create_sender(8, "req-8", 16)
    assert sender.poll() is KVPoll.FAILED and sender.failure_reason() == "decode not registered"


def test_a_room_named_for_a_refused_registration_fails_at_once(rig: Rig) -> None:
    rig.refusals.names.add("decode-9", "dtype bfloat16, not float32", rig.now)
    sender = rig.hub.create_sender(7, "req-7", 16, allowed_peer="decode-9")
    assert sender.failure_reason() == "registration refused: dtype bfloat16, not float32"
    waiting = rig.hub.create_sender(8, "req-8", 16)  # no decode named: it waits, and says why
    assert waiting.poll() is KVPoll.BOOTSTRAPPING
    if isinstance(rig.peer, SglangPeer):
        assert waiting.why_no_handshake() is None  # a refused SGLang decode still asks
    else:
        assert "'decode-9' (dtype bfloat16, not float32)" in (waiting.why_no_handshake() or "")


def test_a_dropped_peer_hears_about_the_rooms_it_still_wanted(rig: Rig) -> None:
    rig.hub.want(rig.peer, wire.Want.of(9, [3, 4], 2, 0))  # no request yet: a claim
    rig.hub.drop_peer(rig.peer, "decode peer left")
    [(room, code, reason, _)] = rig.heard.said
    assert (room, code) == (9, "failed") and reason is not None and "decode peer left" in reason
    assert rig.hub.rooms.num_claims(9) == 0
    sender = rig.hub.create_sender(9, "req-9", 16)  # the request finds no claim: it waits
    assert sender.poll() is KVPoll.BOOTSTRAPPING
