"""Wire protocol v1: every message round-trips, and every bad frame decodes to its reject."""

from __future__ import annotations

import dataclasses
import math
from array import array
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from msgspec import UNSET

from prefill_worker.ingress.messages import (
    Abort,
    Drain,
    Load,
    Ping,
    Pong,
    Prefill,
    ProtocolError,
    Reject,
    RejectCode,
    Result,
    TraceContextField,
    decode_worker,
    encode,
    encode_outcome,
    pack_logprobs,
    pack_tokens,
    prefill_message,
    unpack_logprobs,
    unpack_tokens,
)
from prefill_worker.ingress.validate import Limits, decode_router
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
    Timings,
    TraceContext,
)

LIMITS = Limits(vocab_size=1000, max_prompt_tokens=64, max_pool_tokens=48)
DOCS = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def prefill_map(**changes: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "v": 1,
        "type": "prefill",
        "request_id": "r-1",
        "token_ids": pack_tokens([1, 2, 3]),
        "bootstrap_room": 42,
        "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 10, "seed": 7},
        "return_logprob": True,
        "deadline_s": 2.5,
    }
    m.update(changes)
    return {k: v for k, v in m.items() if v is not _DROP}


_DROP = object()


def decode_map(m: Any, limits: Limits = LIMITS) -> Any:
    return decode_router(msgpack.packb(m, use_bin_type=True), limits)


def expect_reject(m: Any, code: RejectCode, field: str | None = None) -> Reject:
    got = decode_map(m)
    assert isinstance(got, Reject), got
    assert got.code is code, got
    if field is not None:
        assert got.field == field and field in got.message, got
    return got


# ── round trips ─────────────────────────────────────────────────────────────────────────────


def as_request(msg: Prefill, arrival_time: float) -> PrefillRequest:
    """What the engine should get for a valid ``prefill``."""
    s = msg.sampling
    assert s is not None
    seed = s.seed if isinstance(s.seed, int) else None
    return PrefillRequest(
        msg.request_id,
        unpack_tokens(msg.token_ids),
        SamplingParams(s.temperature, s.top_p, s.top_k, seed),
        msg.return_logprob,
        msg.bootstrap_room,
        arrival_time,
        msg.deadline_s if isinstance(msg.deadline_s, float) else None,
        msg.decode_peer if isinstance(msg.decode_peer, str) else None,
        msg.logprob_start_len if isinstance(msg.logprob_start_len, int) else None,
    )


@pytest.mark.parametrize(
    "msg",
    [
        prefill_message("a", [0, 999, 5], 0),
        prefill_message("b" * 256, range(48), 2**63 - 1, SamplingParams(1.5, 0.5, 3, 9)),
        prefill_message("c", [1], 5, SamplingParams(), True, 0.25),
        prefill_message("d", [1], 6, decode_peer="decode-agent-1"),
        prefill_message("e", [1, 2, 3], 7, return_logprob=True, logprob_start_len=1),
        Abort(request_id="r-9"),
        Ping(),
        Ping(nonce=17),
        Drain(),
        Drain(nonce=3),
    ],
)
def test_router_messages_round_trip(msg: Any) -> None:
    expected: Any = msg
    if isinstance(msg, Prefill):
        expected = as_request(msg, arrival_time=3.5)
    elif isinstance(msg, Abort):
        expected = AbortRequest(msg.request_id)
    assert decode_router(encode(msg), LIMITS, 3.5) == expected


@pytest.mark.parametrize(
    "msg",
    [
        Result(
            request_id="r",
            status=OutcomeStatus.OK,
            reason=FinishReason.OK,
            num_prompt_tokens=10,
            num_cached_tokens=4,
            first_token_id=7,
            first_token_logprob=-0.25,
            timings=Timings(1, 2, 3, 4),
        ),
        Result(
            request_id="r",
            status=OutcomeStatus.OK,
            reason=FinishReason.OK,
            num_prompt_tokens=4,
            num_cached_tokens=0,
            first_token_id=7,
            first_token_logprob=-0.25,
            prompt_logprobs=pack_logprobs([-1.5, -0.125]),
            timings=Timings(),
        ),
        Result(
            request_id="r",
            status=OutcomeStatus.FAILED,
            reason=FinishReason.PEER_LOST,
            num_prompt_tokens=3,
            num_cached_tokens=0,
            error="gone",
            timings=Timings(),
        ),
        Reject(code=RejectCode.DRAINING, message="draining", request_id="r", field="request_id"),
        Reject(code=RejectCode.MALFORMED, message="not a map"),
        Reject(code=RejectCode.FORBIDDEN, message="drain is off", field="type", nonce=12),
        Pong(load=Load(waiting=1, running=2, free_kv_pages=3, draining=True), nonce=5),
        Pong(load=Load(waiting=0, running=0, free_kv_pages=0, draining=False)),
    ],
)
def test_worker_messages_round_trip(msg: Any) -> None:
    assert decode_worker(encode(msg)) == msg


def test_prefill_becomes_a_prefill_request() -> None:
    req = decode_router(msgpack.packb(prefill_map()), LIMITS, arrival_time=12.5)
    assert req == PrefillRequest(
        "r-1", array("i", [1, 2, 3]), SamplingParams(0.5, 0.9, 10, 7), True, 42, 12.5, 2.5
    )
    assert isinstance(req.token_ids, array) and req.token_ids.typecode == "i"


def test_outcome_maps_to_result_and_logprob_only_when_the_outcome_has_one() -> None:
    outcome = Outcome(
        "r", OutcomeStatus.ABORTED, FinishReason.ABORTED_BY_ROUTER, 9, 1, 4, -1.5, "stop"
    )
    not_asked = dataclasses.replace(outcome, first_token_logprob=None)  # the engine's rule
    with_lp = decode_worker(encode_outcome(outcome))
    without = decode_worker(encode_outcome(not_asked))
    assert isinstance(with_lp, Result) and isinstance(without, Result)
    assert with_lp.first_token_logprob == -1.5 and without.first_token_logprob is UNSET
    assert "first_token_logprob" not in msgpack.unpackb(encode_outcome(not_asked))
    assert (with_lp.status, with_lp.reason, with_lp.error) == (
        OutcomeStatus.ABORTED,
        FinishReason.ABORTED_BY_ROUTER,
        "stop",
    )
    assert (with_lp.num_prompt_tokens, with_lp.num_cached_tokens, with_lp.first_token_id) == (
        9,
        1,
        4,
    )


def test_tokens_are_packed_little_endian_int32() -> None:
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert pack_tokens(np.array([1, 256], dtype=np.int64)) == pack_tokens([1, 256])
    assert pack_tokens(array("i", [7])) == b"\x07\x00\x00\x00"
    assert unpack_tokens(pack_tokens([-1, 2**31 - 1])) == array("i", [-1, 2**31 - 1])


def test_optional_fields_default_and_extra_fields_are_ignored() -> None:
    m = prefill_map(sampling=_DROP, return_logprob=_DROP, deadline_s=_DROP, shiny="new")
    msg = decode_map(m)
    assert isinstance(msg, PrefillRequest)
    assert (msg.sampling, msg.return_logprob, msg.deadline_s) == (SamplingParams(), False, None)
    assert decode_map(prefill_map(sampling={"top_k": 1})).sampling == SamplingParams(top_k=1)
    assert decode_map({"v": 1, "type": "ping", "x": [1, 2]}) == Ping()


# ── one test per reject code ────────────────────────────────────────────────────────────────


def test_bad_version() -> None:
    for v in (2, 0, "1", 1.0, None):
        expect_reject(prefill_map(v=v), RejectCode.BAD_VERSION, "v")


def test_unknown_type() -> None:
    got = expect_reject({"v": 1, "type": "launch", "request_id": "r"}, RejectCode.UNKNOWN_TYPE)
    assert got.field == "type" and "launch" in got.message


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb("prefill"), b"\x85\xa1v", b"\x81\x01\x02"],
)
def test_malformed(frame: bytes) -> None:
    got = decode_router(frame, LIMITS)
    assert isinstance(got, Reject) and got.code is RejectCode.MALFORMED


@pytest.mark.parametrize("field", ["v", "type", "request_id", "token_ids", "bootstrap_room"])
def test_missing_field(field: str) -> None:
    got = expect_reject(prefill_map(**{field: _DROP}), RejectCode.MISSING_FIELD, field)
    if field not in ("v", "type", "request_id"):
        assert got.request_id == "r-1"
    expect_reject({"v": 1, "type": "abort"}, RejectCode.MISSING_FIELD, "request_id")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"type": 3}, "type"),
        ({"request_id": 5}, "request_id"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * 257}, "request_id"),
        ({"token_ids": [1, 2, 3]}, "token_ids"),
        ({"token_ids": b"\x01\x00\x00"}, "token_ids"),
        ({"token_ids": "abcd"}, "token_ids"),
        ({"bootstrap_room": "7"}, "bootstrap_room"),
        ({"bootstrap_room": -1}, "bootstrap_room"),
        ({"bootstrap_room": 2**63}, "bootstrap_room"),
        ({"bootstrap_room": True}, "bootstrap_room"),
        ({"sampling": [0.5]}, "sampling"),
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature"),
        ({"sampling": {"top_p": None}}, "sampling.top_p"),
        ({"sampling": {"top_k": 2.0}}, "sampling.top_k"),
        ({"sampling": {"seed": "s"}}, "sampling.seed"),
        ({"return_logprob": 1}, "return_logprob"),
        ({"deadline_s": -1.0}, "deadline_s"),
        ({"deadline_s": math.inf}, "deadline_s"),
        ({"deadline_s": "soon"}, "deadline_s"),
        ({"decode_peer": ""}, "decode_peer"),
        ({"decode_peer": 7}, "decode_peer"),
        ({"decode_peer": "d" * 257}, "decode_peer"),
        ({"logprob_start_len": "0"}, "logprob_start_len"),
        ({"logprob_start_len": True}, "logprob_start_len"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"logprob_start_len": 4}, "logprob_start_len"),  # beyond the 3-token prompt
        ({"trace_context": "00-ab-cd-01"}, "trace_context"),
        ({"trace_context": {"traceparent": 7}}, "trace_context.traceparent"),
        ({"trace_context": {"traceparent": "t" * 257}}, "trace_context.traceparent"),
        ({"trace_context": {"traceparent": "t", "tracestate": 1}}, "trace_context.tracestate"),
        (
            {"trace_context": {"traceparent": "t", "tracestate": "s" * 513}},
            "trace_context.tracestate",
        ),
    ],
)
def test_bad_field(changes: dict[str, Any], field: str) -> None:
    expect_reject(prefill_map(**changes), RejectCode.BAD_FIELD, field)


def test_bad_field_in_ping_nonce() -> None:
    expect_reject({"v": 1, "type": "ping", "nonce": "n"}, RejectCode.BAD_FIELD, "nonce")


def test_empty_prompt() -> None:
    got = expect_reject(prefill_map(token_ids=b""), RejectCode.EMPTY_PROMPT, "token_ids")
    assert got.request_id == "r-1"


@pytest.mark.parametrize("n", [10, 500])
def test_token_out_of_range(n: int) -> None:
    limits = Limits(1000, 1000, 1000)
    for bad in (1000, -1, 2**31 - 1):
        ids = [3] * n
        ids[n // 2] = bad
        got = decode_map(prefill_map(token_ids=pack_tokens(ids)), limits)
        assert isinstance(got, Reject) and got.code is RejectCode.TOKEN_OUT_OF_RANGE
        assert f"token_ids[{n // 2}] = {bad}" in got.message and got.field == "token_ids"
    ok = decode_map(prefill_map(token_ids=pack_tokens([0] * n + [999])), limits)
    assert isinstance(ok, PrefillRequest)


def test_prompt_too_long() -> None:
    over_max = expect_reject(
        prefill_map(token_ids=pack_tokens([1] * 65)), RejectCode.PROMPT_TOO_LONG, "token_ids"
    )
    assert "max_prompt_tokens=64" in over_max.message
    over_pool = expect_reject(
        prefill_map(token_ids=pack_tokens([1] * 49)), RejectCode.PROMPT_TOO_LONG, "token_ids"
    )
    assert "KV pool" in over_pool.message
    assert isinstance(decode_map(prefill_map(token_ids=pack_tokens([1] * 48))), PrefillRequest)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"temperature": -math.inf}, "sampling.temperature"),
        ({"temperature": -1e-300}, "sampling.temperature"),
        ({"temperature": 1e308}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_p": math.nan}, "sampling.top_p"),
        ({"top_p": -math.inf}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"seed": -5}, "sampling.seed"),
        ({"seed": -(2**63)}, "sampling.seed"),
    ],
)
def test_bad_sampling(sampling: dict[str, Any], field: str) -> None:
    got = expect_reject(prefill_map(sampling=sampling), RejectCode.BAD_SAMPLING, field)
    assert got.request_id == "r-1"


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-39, "top_p": 1.0},
        {"temperature": 5e-324, "top_p": 1e-300},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 100.0, "top_p": 5e-324, "top_k": 2**64 - 1},
        {"temperature": 0.7, "top_k": 2**63, "seed": 2**63 - 1},
        {"temperature": 1, "top_p": 1, "top_k": 0, "seed": 0},
    ],
)
def test_extreme_sampling_in_range_is_accepted(sampling: dict[str, Any]) -> None:
    # The sampler must serve these (never NaN); the protocol does not refuse them.
    got = decode_map(prefill_map(sampling=sampling))
    assert isinstance(got, PrefillRequest), got
    assert got.sampling.temperature == sampling["temperature"]


@pytest.mark.parametrize(
    "extra",
    [
        {"junk": list(range(100_000))},
        {"junk": {str(i): i for i in range(100_000)}},
        {"token_ids": list(range(100_000))},
    ],
)
def test_big_arrays_and_maps_are_refused_while_unpacking(extra: dict[str, Any]) -> None:
    got = decode_map(prefill_map(**extra))
    assert isinstance(got, Reject) and got.code is RejectCode.MALFORMED
    assert "at most 64 items" in got.message


def test_the_decode_peer_is_carried() -> None:
    req = decode_map(prefill_map(decode_peer="decode-agent-3"))
    assert isinstance(req, PrefillRequest) and req.decode_peer == "decode-agent-3"
    assert decode_map(prefill_map(decode_peer=None)).decode_peer is None


def test_the_trace_context_is_carried_as_sent() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    both = {"traceparent": parent, "tracestate": "smg=1,x=2"}
    req = decode_map(prefill_map(trace_context=both))
    assert isinstance(req, PrefillRequest)
    assert req.trace_context == TraceContext(parent, "smg=1,x=2")
    only_parent = decode_map(prefill_map(trace_context={"traceparent": parent}))
    assert only_parent.trace_context == TraceContext(parent, None)
    nil_state = {"traceparent": parent, "tracestate": None}
    assert decode_map(prefill_map(trace_context=nil_state)).trace_context == TraceContext(parent)
    assert decode_map(prefill_map(trace_context=None)).trace_context is None
    assert decode_map(prefill_map()).trace_context is None
    # the longest allowed values pass untouched (W3C's format is the tracer's to judge)
    longest = {"traceparent": "t" * 256, "tracestate": "s" * 512}
    assert decode_map(prefill_map(trace_context=longest)).trace_context == TraceContext(
        "t" * 256, "s" * 512
    )


def test_prefill_message_sends_a_traceparent() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    msg = prefill_message("r", [1, 2], 5, traceparent=parent)
    assert msg.trace_context == TraceContextField(traceparent=parent)
    assert prefill_message("r", [1, 2], 5).trace_context is UNSET
    req = decode_router(encode(msg), LIMITS)
    assert isinstance(req, PrefillRequest) and req.trace_context == TraceContext(parent)


def test_prompt_logprobs_are_asked_by_position_and_come_back_packed() -> None:
    for start, want in ((0, 0), (2, 2), (3, 3), (-1, None), (None, None), (_DROP, None)):
        req = decode_map(prefill_map(logprob_start_len=start))
        assert isinstance(req, PrefillRequest) and req.prompt_logprob_start == want, start
    outcome = Outcome("r", OutcomeStatus.OK, FinishReason.OK, 4, prompt_logprobs=(-1.5, -0.75))
    result = decode_worker(encode_outcome(outcome))
    assert isinstance(result, Result) and isinstance(result.prompt_logprobs, bytes)
    assert list(unpack_logprobs(result.prompt_logprobs)) == [-1.5, -0.75]
    assert pack_logprobs([-0.5]) == b"\x00\x00\x00\xbf"  # little-endian float32
    not_asked = decode_worker(encode_outcome(dataclasses.replace(outcome, prompt_logprobs=None)))
    assert isinstance(not_asked, Result) and not_asked.prompt_logprobs is UNSET
    assert "prompt_logprobs" not in msgpack.unpackb(encode_outcome(not_asked_outcome()))


def not_asked_outcome() -> Outcome:
    return Outcome("r", OutcomeStatus.OK, FinishReason.OK, 4)


def test_the_result_carries_the_routers_own_id() -> None:
    outcome = Outcome("00ab12cd34/r-7", OutcomeStatus.OK, FinishReason.OK, 3)
    result = decode_worker(encode_outcome(outcome, request_id="r-7"))
    assert isinstance(result, Result) and result.request_id == "r-7"


def test_every_reject_code_is_documented() -> None:
    text = DOCS.read_text()
    for code in RejectCode:
        assert f"`{code.value}`" in text, code


# ── the client's side: a worker that breaks the contract ────────────────────────────────────


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",
        msgpack.packb({"v": 2, "type": "pong", "load": {}}),
        msgpack.packb({"v": 1, "type": "hello"}),
        msgpack.packb({"v": 1, "type": "result", "request_id": "r"}),
        msgpack.packb({"v": 1, "type": "reject", "code": "nope", "message": "m"}),
        msgpack.packb({"v": 1, "type": "pong", "load": {"waiting": 1}}),
    ],
)
def test_unreadable_worker_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_worker(frame)


def test_prefill_retries_are_sent_only_when_there_were_some() -> None:
    outcome = Outcome("r", OutcomeStatus.OK, FinishReason.OK, 9, prefill_retries=2)
    result = decode_worker(encode_outcome(outcome))
    assert isinstance(result, Result) and result.prefill_retries == 2
    none = encode_outcome(dataclasses.replace(outcome, prefill_retries=0))
    assert "prefill_retries" not in msgpack.unpackb(none)  # v1 frames as before
