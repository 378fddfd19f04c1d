"""Pins for the SGLang desk (on test_sglang_desk's rig): behaviours that mutation testing
(`make mutation`, scripts/mutation.py) found no test held: what a refused or unknown decode
hears, which room fails with it, and the log line each refusal leaves."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.push.refusals import RefusedRoom
from prefill_worker.transfer.sglang import frames
from prefill_worker.transfer.sglang.desk import NOT_REGISTERED
from prefill_worker.transfer.sglang.frames import AbortNotice, TransferRequest, parse
from tests.unit.transfer.test_sglang_desk import Rig, frames_of, registration


def request(**changes: object) -> TransferRequest:
    req = parse(frames_of("request"))
    assert isinstance(req, TransferRequest)
    return dataclasses.replace(req, **changes)  # type: ignore[arg-type]


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name.startswith("prefill_worker.transfer")
    ]


def test_an_unknown_decodes_request_is_refused_and_its_room_remembered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig, req = Rig(), request()
    with caplog.at_level(logging.DEBUG):
        rig.send(req)
    assert rig.replies.sent == [(req.endpoint, frames.kv_status(1234, False, NOT_REGISTERED))]
    assert said(caplog) == [(logging.DEBUG, f"sglang: unknown_peer: {NOT_REGISTERED}")]
    refused = rig.hub.refusals.rooms.take(1234, rig.now)
    assert refused == RefusedRoom(req.agent_name, NOT_REGISTERED)


def test_a_refused_decodes_request_fails_its_waiting_room_with_the_reason() -> None:
    rig = Rig()
    rig.send(dataclasses.replace(registration(), tp_size=3))  # refused
    waiting = rig.hub.create_sender(1234, "req", 16)
    other = rig.hub.create_sender(99, "req-99", 16, allowed_peer="someone-else")
    rig.send(request())
    rig.send(request(room=99))
    why = rig.replies.sent[0][1][4].decode()
    assert why.startswith("registration refused: decode attention TP size 3")
    assert waiting.failure_reason() == why and other.poll() is KVPoll.BOOTSTRAPPING


def test_in_the_rejoin_window_an_unknown_decode_hears_nothing() -> None:
    rig = Rig(is_rejoining=True)
    rig.send(request())
    assert not rig.replies.sent and rig.hub.counter.counts == {"unknown_peer": 1}
    assert rig.hub.refusals.rooms.take(1234, rig.now) is None


def test_refusals_of_registrations_are_logged_with_the_agent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()
    reg = registration()
    with caplog.at_level(logging.DEBUG):
        rig.send(dataclasses.replace(reg, tp_size=3))
    [(level, message)] = said(caplog)
    assert level == logging.WARNING
    assert message.startswith(f"sglang: unsupported: registration of {reg.agent_name} refused: ")
    rig.send(request())
    assert rig.replies.sent[-1][1][4].decode().startswith("registration refused: decode attention")


def test_a_registration_is_logged_and_a_repeat_with_another_pool_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig, reg = Rig(), registration()
    with caplog.at_level(logging.INFO):
        rig.send(reg)
        rig.send(reg)  # the same pool again: nothing to say
        rig.send(dataclasses.replace(reg, num_slots=9))
    assert said(caplog) == [
        (logging.INFO, f"sglang: decode {reg.agent_name} registered (17 pages)"),
        (
            logging.WARNING,
            f"sglang: name_taken: agent {reg.agent_name!r} is registered with another pool",
        ),
    ]


@pytest.mark.parametrize("failure", ["add", "prep", "aux"])
def test_nixl_refusing_a_decode_is_remembered_for_its_requests(failure: str) -> None:
    rig, reg = Rig(), registration()
    released: list[bool] = []

    class List:
        def release(self) -> None:
            released.append(True)

    calls: list[str] = []

    def add(metadata: bytes) -> str:
        if failure == "add":
            raise NIXL_ERRORS[0]("bad blob")
        rig.agent.remote.append(reg.agent_name)
        return reg.agent_name

    def prep(name: str, table: object, mem_type: str) -> List:
        calls.append(mem_type)
        if failure == "prep" or (failure == "aux" and len(calls) == 2):
            raise NIXL_ERRORS[0]("no such memory")
        return List()

    rig.agent.add_remote_agent = add  # type: ignore[method-assign]
    rig.agent.prep_xfer_dlist = prep  # type: ignore[method-assign,assignment]
    rig.send(reg)
    assert not rig.hub.peers and not rig.agent.remote
    assert released == ([True] if failure == "aux" else [])
    rig.send(request())
    reason = rig.replies.sent[-1][1][4].decode()
    if failure == "add":
        assert reason == "registration refused: bad blob"
    else:
        assert (
            reason
            == "registration refused: NIXL cannot address the decode's buffers: no such memory"
        )
    assert rig.hub.counter.counts["nixl_refused"] == 1


def test_nixl_naming_another_agent_is_refused_and_that_agent_removed() -> None:
    rig, reg = Rig(), registration()

    def add(metadata: bytes) -> bytes:
        rig.agent.remote.append("impostor")
        return b"impostor"

    rig.agent.add_remote_agent = add  # type: ignore[method-assign,assignment]
    rig.send(reg)
    assert not rig.hub.peers and rig.agent.remote == []
    rig.send(request())
    assert rig.replies.sent[-1][1][4].decode() == (
        f"registration refused: metadata names agent 'impostor', not {reg.agent_name!r}"
    )


def test_a_request_naming_an_agent_at_another_address_is_refused_there() -> None:
    rig = Rig()
    rig.send(registration())
    req = request(endpoint=frames.Endpoint("127.0.0.1", 1))
    rig.send(req)
    why = f"agent {req.agent_name!r} is registered from another address"
    assert rig.replies.sent == [(req.endpoint, frames.kv_status(1234, False, why))]
    assert rig.hub.counter.counts == {"foreign_agent": 1}


def test_a_known_decodes_request_refreshes_it_and_a_bad_one_fails_its_room() -> None:
    rig = Rig()
    rig.send(registration())
    [peer] = rig.hub.peers.values()
    rig.now = 3.0
    rig.send(request(required_dst_info_num=2))
    assert peer.last_seen == 3.0 and rig.hub.counter.counts == {"unsupported": 1}
    assert rig.replies.sent[-1][1][2] == b"0"  # KV_STATUS failed
    rig.send(request(packed_page_ids=b"\x00" * 4 * 10_000))  # more pages than any prompt
    assert rig.hub.counter.counts["bad_want"] == 1 and rig.hub.rooms.num_claims(1234) == 0


def test_an_abort_from_no_peer_is_acknowledged_with_its_generation() -> None:
    rig = Rig()
    notice = parse(frames_of("abort"))
    assert isinstance(notice, AbortNotice)
    rig.send(notice)
    assert rig.replies.sent == [(notice.endpoint, frames.abort_ack(1234, notice.generation))]


def test_a_frame_error_and_a_spoofed_frame_are_counted_with_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()
    with caplog.at_level(logging.DEBUG):
        rig.desk.dispatch(frames.FrameError("an empty message"), "127.0.0.1")
        rig.send(request(), source_ip="10.9.9.9")
    assert said(caplog) == [
        (logging.WARNING, "sglang: bad_message: unreadable control frame: an empty message"),
        (
            logging.WARNING,
            "sglang: spoofed_address: TransferRequest dropped: the frame names 127.0.0.1 "
            "but came from 10.9.9.9",
        ),
    ]
    assert not rig.replies.sent


def test_a_message_that_raises_is_counted_and_goes_no_further(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()

    def boom(*args: object) -> None:
        raise RuntimeError("boom")

    rig.hub.want = boom  # type: ignore[method-assign,assignment]
    rig.send(registration())
    with caplog.at_level(logging.DEBUG):
        rig.send(request())
    assert said(caplog) == [
        (logging.WARNING, "sglang: internal_error: on a control message: RuntimeError('boom')")
    ]


def test_in_the_rejoin_window_the_count_says_so(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(is_rejoining=True)
    with caplog.at_level(logging.DEBUG):
        rig.send(request())
    assert said(caplog) == [(logging.DEBUG, "sglang: unknown_peer: during the rejoin window")]


def test_a_registration_prepares_the_pool_and_row_0_of_each_metadata_buffer() -> None:
    rig, reg = Rig(), registration()
    calls: list[tuple[str, object, str]] = []
    prep = rig.agent.prep_xfer_dlist

    def recording(name: str, table: object, mem_type: str) -> object:
        calls.append((name, table, mem_type))
        return prep(name, table, mem_type)

    rig.agent.prep_xfer_dlist = recording  # type: ignore[method-assign,assignment]
    rig.now = 2.0
    rig.send(reg)
    [(kv_name, kv_table, kv_mem), (aux_name, rows, aux_mem)] = calls
    assert (kv_name, kv_mem, aux_name, aux_mem) == (reg.agent_name, "DRAM", reg.agent_name, "DRAM")
    assert len(kv_table) == 4  # type: ignore[arg-type]  # K and V of 2 layers, 17 pages each
    assert [int(r[0]) for r in rows] == list(reg.aux_ptrs)  # type: ignore[attr-defined]
    assert rows.dtype.name == "uint64"  # type: ignore[attr-defined]
    peer = rig.hub.peers[reg.agent_name.encode()]
    assert (peer.last_seen, peer.aux_ptrs) == (2.0, reg.aux_ptrs)
    assert rig.hub.counter.counts == {}
    rig.send(reg)  # the same pool again: not counted
    assert rig.hub.counter.counts == {}


def test_the_owners_abort_is_acknowledged_with_its_generation() -> None:
    rig = Rig()
    rig.send(registration())
    rig.send(request())  # a want waiting for its request
    notice = parse(frames_of("abort"))
    assert isinstance(notice, AbortNotice) and notice.generation is not None
    rig.send(notice)
    assert rig.replies.sent[-1] == (notice.endpoint, frames.abort_ack(1234, notice.generation))
    assert rig.hub.rooms.num_claims(1234) == 0


def test_a_room_named_for_the_refused_decode_fails_with_its_reason() -> None:
    rig = Rig()
    reg = registration()
    rig.send(dataclasses.replace(reg, tp_size=3))
    named = rig.hub.create_sender(1234, "req", 16, allowed_peer=reg.agent_name)
    rig.send(request())
    assert (named.failure_reason() or "").startswith("registration refused: decode attention")


def test_an_address_a_live_decode_holds_is_refused_with_both_named() -> None:
    rig = Rig()
    first = registration()
    rig.send(first)
    rig.send(request())  # a waiting want: the holder is live
    second = registration("decode-b")
    rig.send(second)
    rig.send(request(agent_name="decode-b"))
    where = f"{first.endpoint.host}:{first.endpoint.port}"
    assert rig.replies.sent[-1][1][4].decode() == (
        f"registration refused: {where} is registered by live agent {first.agent_name!r}"
    )


def test_a_registration_clears_its_agents_earlier_refusal() -> None:
    rig, reg = Rig(), registration()
    rig.send(dataclasses.replace(reg, tp_size=3))
    rig.send(reg)
    rig.hub.drop_peer(rig.hub.peers[reg.agent_name.encode()], "gone")
    rig.send(request())
    assert rig.replies.sent[-1][1][4].decode() == NOT_REGISTERED


def test_the_count_of_an_error_is_cut_at_300_characters(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()

    def boom(*args: object) -> None:
        raise RuntimeError("x" * 400)

    rig.hub.want = boom  # type: ignore[method-assign,assignment]
    rig.send(registration())
    with caplog.at_level(logging.DEBUG):
        rig.send(request())
    [(_, message)] = said(caplog)
    assert (
        message
        == "sglang: internal_error: " + f"on a control message: {RuntimeError('x' * 400)!r}"[:300]
    )
