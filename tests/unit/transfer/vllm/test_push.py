"""vLLM's push mode without a decode: a ``PUSH_REG`` read as vLLM writes it (and refused when
it is not), matched to its held request by vLLM's base request id in either order, a second
request or registration under one id not matched; the desk's push answers (params and the
expected registration); the front's push tickets (the id from X-Request-Id or the body, a
push without one or to a worker not serving push refused 400)."""

from __future__ import annotations

import json

import msgspec
import pytest

from prefill_worker.ingress.http.bodies import BadRequest, read_completion
from prefill_worker.ingress.http.pull import open_pulls
from prefill_worker.transfer.vllm.profiles import PULL, PUSH, channel_key
from prefill_worker.transfer.vllm.push import (
    PUSH_REG_PREFIX,
    BadRegistration,
    PushBook,
    Registration,
    base_request_id,
    push_key,
    read_registration,
)
from prefill_worker.transfer.vllm.tickets import Tickets

REG = {  # vLLM's push scheduler's registration (update_state_after_alloc)
    "request_id": "cmpl-abc-0-0123abcd",
    "decode_engine_id": "decode-1",
    "decode_host": "127.0.0.1",
    "decode_port": 5700,
    "decode_tp_size": 1,
    "local_block_ids": [[7, 3, 9]],
    "remote_engine_id": "prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 5602,
    "remote_tp_size": 1,
    "remote_pp_size": 1,
}
ASK = {"do_remote_decode": True, "vllm_version": "0.34.0", "transfer_mode": "push"}


def _notif(reg: object) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(reg)


def test_a_registration_is_read_as_vllm_writes_it() -> None:
    reg = read_registration(_notif(REG))
    assert reg.request_id == "cmpl-abc-0-0123abcd" and reg.block_ids() == [7, 3, 9]
    assert read_registration(_notif({**REG, "local_block_ids": [4, 5]})).block_ids() == [4, 5]
    assert base_request_id(reg.request_id) == "cmpl-abc-0" == push_key("abc")
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"  # no suffix: itself


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\xc1", "not vLLM's registration"),
        (msgspec.msgpack.encode({"request_id": "x"}), "not vLLM's registration"),
        (msgspec.msgpack.encode({**REG, "local_block_ids": [[1], [2]]}), "2 KV-cache groups"),
        (msgspec.msgpack.encode({**REG, "local_block_ids": [[-1]]}), "not block ids"),
        (msgspec.msgpack.encode({**REG, "local_block_ids": [["a"]]}), "not block ids"),
        (b"\x00" * (1 << 20 + 1), "bytes"),
    ],
)
def test_a_bad_registration_is_refused_with_its_reason(body: bytes, why: str) -> None:
    with pytest.raises(BadRegistration, match=why):
        read_registration(PUSH_REG_PREFIX + body)


def test_a_registration_matches_its_hold_in_either_order() -> None:
    book = PushBook(lease_s=30.0, max_early=2)
    reg = read_registration(_notif(REG))
    assert book.expect("cmpl-abc-0", "pw-1", "0.34.0", 0.0) is None
    wanted = book.registered("agent", reg, 1.0)
    assert wanted is not None and wanted.hold_id == "pw-1" and wanted.version == "0.34.0"
    assert book.registered("agent", reg, 1.0) is None  # matched once: a second one waits
    assert book.early  # ... as a registration that came first would
    book.prune(40.0)
    assert not book.early and book.refused["unmatched"] == 1
    early = read_registration(_notif({**REG, "request_id": "cmpl-def-0-89abcdef"}))
    assert book.registered("decode", early, 50.0) is None
    pair = book.expect("cmpl-def-0", "pw-2", "0.33.0", 51.0)
    assert pair is not None and pair[0].hold_id == "pw-2" and pair[1].agent == "decode"
    assert not book.expected and not book.early


def test_a_late_hold_does_not_take_an_expired_registration_and_early_ones_are_bounded() -> None:
    book = PushBook(lease_s=5.0, max_early=1)
    one = read_registration(_notif({**REG, "request_id": "cmpl-one-0-00000000"}))
    two = read_registration(_notif({**REG, "request_id": "cmpl-two-0-00000000"}))
    assert book.registered("a", one, 0.0) is None and book.registered("a", two, 0.0) is None
    assert book.refused["too_many_early"] == 1 and list(book.early) == ["cmpl-one-0"]
    assert book.expect("cmpl-one-0", "pw-1", "0.34.0", 6.0) is None  # past its lease
    assert book.expected["cmpl-one-0"].hold_id == "pw-1"


def test_two_requests_under_one_id_match_only_the_first_and_ended_holds_stop_waiting() -> None:
    book = PushBook(lease_s=30.0, max_early=4)
    assert book.expect("cmpl-x-0", "pw-1", "0.34.0", 0.0) is None
    assert book.expect("cmpl-x-0", "pw-2", "0.34.0", 0.0) is None
    assert book.refused["duplicate_request_id"] == 1
    assert book.expected["cmpl-x-0"].hold_id == "pw-1"
    book.forget_missing(lambda hold_id: hold_id != "pw-1")
    assert not book.expected


def test_the_front_opens_a_push_ticket_under_vllms_request_id() -> None:
    tickets = Tickets(4, ("0.33.0", "0.34.0"), (PULL, PUSH))
    body = {"prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": ASK}
    (push,) = read_completion(json.dumps(body).encode(), 8)
    open_pulls(tickets, [push], "req-7")
    ask = tickets.ask_of(push.bootstrap_room)
    assert ask is not None and (ask.version, ask.mode, ask.push_key) == (
        "0.34.0",
        PUSH,
        "cmpl-req-7-0",
    )
    (named,) = read_completion(json.dumps({**body, "request_id": "body-id"}).encode(), 8)
    open_pulls(tickets, [named])
    assert tickets.ask_of(named.bootstrap_room).push_key == "cmpl-body-id-0"  # type: ignore[union-attr]
    (pull,) = read_completion(
        json.dumps({**body, "kv_transfer_params": {**ASK, "transfer_mode": None}}).encode(), 8
    )
    open_pulls(tickets, [pull], "req-8")
    assert tickets.ask_of(pull.bootstrap_room).push_key is None  # type: ignore[union-attr]
    assert channel_key("0.34.0", PUSH) == "0.34.0+push" and channel_key("0.34.0") == "0.34.0"


@pytest.mark.parametrize(
    ("modes", "ask", "header", "why"),
    [
        ((PULL,), ASK, "id", "transfer_mode: 'push'; this worker serves pull"),
        ((PULL, PUSH), {**ASK, "transfer_mode": "write"}, "id", "'write'; this worker serves"),
        ((PULL, PUSH), ASK, None, "send X-Request-Id"),
    ],
)
def test_a_push_the_worker_cannot_serve_is_refused(
    modes: tuple[str, ...], ask: dict[str, object], header: str | None, why: str
) -> None:
    tickets = Tickets(4, ("0.34.0",), modes)
    body = {"prompt": [1], "max_tokens": 1, "kv_transfer_params": ask}
    (prompt,) = read_completion(json.dumps(body).encode(), 8)
    with pytest.raises(BadRequest, match=why) as caught:
        open_pulls(tickets, [prompt], header)
    assert caught.value.status == 400 and len(tickets) == 0


def test_every_rank_of_a_tp_2_decode_registers_and_the_first_serves_them_all() -> None:
    """vLLM's push decode of TP 2 sends its registration from each rank: the first matches,
    the other rank's is its sibling (neither matched again nor counted), in either order;
    a third, or another engine's, is not a sibling; a sibling never sent is forgotten."""
    book = PushBook(lease_s=30.0, max_early=8)

    def reg(rid: str, engine: str = "decode-1") -> Registration:
        body = {**REG, "request_id": f"cmpl-{rid}-0-0123abcd", "decode_tp_size": 2}
        return read_registration(_notif({**body, "decode_engine_id": engine}))

    assert book.expect("cmpl-a-0", "pw-1", "0.34.0", 0.0) is None
    wanted = book.registered("rank-0", reg("a"), 1.0)
    assert wanted is not None and wanted.hold_id == "pw-1"
    assert book.registered("rank-1", reg("a"), 1.0) is None
    assert not book.early and not book.siblings and not book.refused
    assert book.registered("rank-2", reg("a"), 1.0) is None and "cmpl-a-0" in book.early

    assert book.registered("rank-0", reg("b"), 2.0) is None  # both before the hold
    assert book.registered("rank-1", reg("b"), 2.0) is None
    assert book.early["cmpl-b-0"].ranks == 2 and not book.refused
    pair = book.expect("cmpl-b-0", "pw-2", "0.34.0", 3.0)
    assert pair is not None and pair[0].hold_id == "pw-2" and not book.siblings

    assert book.registered("rank-0", reg("c"), 4.0) is None  # one before, one after
    assert book.expect("cmpl-c-0", "pw-3", "0.34.0", 5.0) is not None
    assert book.registered("rank-1", reg("c"), 6.0) is None and not book.siblings

    assert book.expect("cmpl-d-0", "pw-4", "0.34.0", 7.0) is None
    assert book.registered("rank-0", reg("d"), 7.0) is not None
    assert book.registered("x", reg("d", engine="decode-2"), 7.0) is None  # not its sibling
    assert "cmpl-d-0" in book.early and "cmpl-d-0" in book.siblings
    book.prune(40.0)
    assert not book.siblings and book.refused["unmatched"] == 2  # a's third, d's stranger
