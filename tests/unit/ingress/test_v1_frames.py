"""Frames recorded from the v1 hand-written codec (``v1_frames.json``, by the script
``tests/unit/ingress/record_v1_frames.py`` of commit b2ba24f) still
decode, to the same fields, and the Structs encode them back to the same map.

The bytes differ only in key order: msgspec writes the ``type`` tag first, the old encoder
wrote ``v`` and ``type`` last (first for ``result``). msgpack maps are unordered, so every
v1 reader accepts both; the maps are compared key by key below."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest

from prefill_worker.ingress.messages import (
    Drain,
    Load,
    Ping,
    Pong,
    Reject,
    RejectCode,
    Result,
    RouterMessage,
    WorkerMessage,
    decode_worker,
    encode,
    encode_outcome,
    prefill_message,
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
)

FRAMES: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).with_name("v1_frames.json")).read_text()
)
LIMITS = Limits(vocab_size=100_000, max_prompt_tokens=64, max_pool_tokens=64)
TIMINGS = Timings(0.001, 0.25, 0.5, 0.125)
EXPECTED: dict[str, Any] = {
    "prefill_full": PrefillRequest(
        "req-full",
        array("i", [1, 2, 3, 70000]),
        SamplingParams(0.7, 0.9, 40, 1234),
        True,
        2**62 + 5,
        0.0,
        2.5,
        "decode-agent-0",
    ),
    "prefill_minimal": PrefillRequest("req-min", array("i", [5]), SamplingParams(), False, 0, 0.0),
    "prefill_sampling_no_seed": PrefillRequest(
        "r3", array("i", [0, 1]), SamplingParams(1.0, 0.5, 0), False, 7, 0.0
    ),
    "abort": AbortRequest("req-full"),
    "ping_nonce": Ping(nonce=42),
    "ping": Ping(),
    "drain_nonce": Drain(nonce=7),
    "drain": Drain(),
    "result_ok_logprob": Result(
        request_id="req-full",
        status=OutcomeStatus.OK,
        reason=FinishReason.OK,
        first_token_id=17,
        num_prompt_tokens=4,
        num_cached_tokens=2,
        timings=TIMINGS,
        first_token_logprob=-0.5,
    ),
    "result_ok_no_logprob": Result(
        request_id="req-min",
        status=OutcomeStatus.OK,
        reason=FinishReason.OK,
        first_token_id=3,
        num_prompt_tokens=1,
        num_cached_tokens=0,
        timings=TIMINGS,
    ),
    "result_failed": Result(
        request_id="r3",
        status=OutcomeStatus.FAILED,
        reason=FinishReason.TRANSFER_TIMEOUT,
        num_prompt_tokens=2,
        num_cached_tokens=0,
        timings=TIMINGS,
        error="transfer_timeout: no decode claimed the room in 30 s",
    ),
    "result_aborted_scoped": Result(
        request_id="req",
        status=OutcomeStatus.ABORTED,
        reason=FinishReason.ROUTER_GONE,
        num_prompt_tokens=2,
        num_cached_tokens=0,
        timings=Timings(),
    ),
    "reject_with_id": Reject(
        code=RejectCode.BAD_SAMPLING,
        message="sampling.top_p must be in (0, 1]",
        request_id="r9",
        field="sampling.top_p",
    ),
    "reject_no_id": Reject(code=RejectCode.MALFORMED, message="frame is not a msgpack map"),
    "reject_nonce": Reject(
        code=RejectCode.FORBIDDEN, message="drain is disabled", field="type", nonce=7
    ),
    "pong_nonce": Pong(
        load=Load(waiting=3, running=2, free_kv_pages=100, draining=False), nonce=42
    ),
    "pong": Pong(load=Load(waiting=0, running=0, free_kv_pages=0, draining=True)),
}
_ANY_MESSAGE = msgspec.msgpack.Decoder(RouterMessage | WorkerMessage)


def _frame(name: str) -> bytes:
    return bytes.fromhex(FRAMES[name]["hex"])


def test_every_message_kind_was_recorded() -> None:
    assert sorted(FRAMES) == sorted(EXPECTED)
    kinds = {FRAMES[name]["map"]["type"] for name in FRAMES}
    assert kinds == {"prefill", "abort", "ping", "drain", "result", "reject", "pong"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_frame_decodes_to_its_fields(name: str) -> None:
    frame = _frame(name)
    is_router = FRAMES[name]["map"]["type"] in ("prefill", "abort", "ping", "drain")
    got = decode_router(frame, LIMITS) if is_router else decode_worker(frame)
    assert got == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_structs_encode_the_recorded_map(name: str) -> None:
    frame = _frame(name)
    again = encode(_ANY_MESSAGE.decode(frame))
    old_map = msgspec.msgpack.decode(frame)
    assert msgspec.msgpack.decode(again) == old_map
    assert sorted(again) == sorted(frame)  # the same bytes, only the keys in another order


ADDED_RESULT_KEYS = {"num_prefix_hit_tokens", "num_computed_tokens"}  # optional, with the cache


def test_outcomes_encode_to_the_recorded_results() -> None:
    """The recorded keys with their values, plus only the optional keys v1 gained since."""
    ok = Outcome("req-min", OutcomeStatus.OK, FinishReason.OK, 1, 0, 3, None, None, TIMINGS)
    scoped = Outcome("ab/req", OutcomeStatus.ABORTED, FinishReason.ROUTER_GONE, 2)
    for frame, name in (
        (encode_outcome(ok), "result_ok_no_logprob"),
        (encode_outcome(scoped, "req"), "result_aborted_scoped"),
    ):
        got, recorded = msgspec.msgpack.decode(frame), msgspec.msgpack.decode(_frame(name))
        assert set(got) - set(recorded) == ADDED_RESULT_KEYS
        assert {k: v for k, v in got.items() if k not in ADDED_RESULT_KEYS} == recorded


def test_prefill_message_encodes_the_recorded_map() -> None:
    msg = prefill_message(
        "req-full",
        [1, 2, 3, 70000],
        2**62 + 5,
        SamplingParams(0.7, 0.9, 40, 1234),
        True,
        2.5,
        "decode-agent-0",
    )
    assert msgspec.msgpack.decode(encode(msg)) == msgspec.msgpack.decode(_frame("prefill_full"))
    minimal = encode(prefill_message("req-min", [5], 0))
    assert msgspec.msgpack.decode(minimal) == msgspec.msgpack.decode(_frame("prefill_minimal"))
