"""The router ingress at its exact boundaries: the last value that passes and the first that
is refused, and the msgpack headers the container cap reads (found unpinned by mutation
testing, `make mutation`)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from prefill_worker.request import PrefillRequest
from prefill_worker.router.admission import Limits, decode_router
from prefill_worker.router.messages import MAX_REQUEST_ID_CHARS, Reject, RejectCode, pack_tokens
from tests.unit.router.test_messages import prefill_map

LIMITS = Limits(vocab_size=1000, max_prompt_tokens=64, max_pool_tokens=48)
CAP = 64  # items per msgpack map or array (admission's safety cap)


def decode(m: dict[str, Any] | bytes, limits: Limits = LIMITS) -> Any:
    frame = m if isinstance(m, bytes) else msgpack.packb(m, use_bin_type=True)
    return decode_router(frame, limits)


def refused(m: dict[str, Any] | bytes, limits: Limits = LIMITS) -> Reject:
    got = decode(m, limits)
    assert isinstance(got, Reject), got
    return got


@pytest.mark.parametrize("num_bytes", [1, 5, 6, 7, 13])
def test_token_ids_not_a_multiple_of_4_bytes_is_a_bad_field_not_an_exception(
    num_bytes: int,
) -> None:
    got = refused(prefill_map(token_ids=b"\x01" * num_bytes))
    assert got.code is RejectCode.BAD_FIELD and got.field == "token_ids"
    assert got.request_id == "r-1"


def test_exactly_max_prompt_tokens_passes_and_one_more_is_too_long() -> None:
    limits = Limits(vocab_size=1000, max_prompt_tokens=64, max_pool_tokens=1000)
    assert isinstance(decode(prefill_map(token_ids=pack_tokens([1] * 64)), limits), PrefillRequest)
    got = refused(prefill_map(token_ids=pack_tokens([1] * 65)), limits)
    assert got.code is RejectCode.PROMPT_TOO_LONG and "max_prompt_tokens=64" in got.message


def test_exactly_the_pool_in_tokens_passes_and_one_more_is_too_long() -> None:
    assert isinstance(decode(prefill_map(token_ids=pack_tokens([1] * 48))), PrefillRequest)
    got = refused(prefill_map(token_ids=pack_tokens([1] * 49)))
    assert got.code is RejectCode.PROMPT_TOO_LONG and "(48)" in got.message


def test_the_largest_token_id_is_vocab_size_minus_1_in_short_and_long_prompts() -> None:
    limits = Limits(vocab_size=1000, max_prompt_tokens=200, max_pool_tokens=200)
    for n in (3, 63, 64, 150):  # below and above the numpy path's threshold
        prompt = [5] * (n - 1)
        assert isinstance(
            decode(prefill_map(token_ids=pack_tokens([*prompt, 999])), limits), PrefillRequest
        )
        got = refused(prefill_map(token_ids=pack_tokens([*prompt, 1000])), limits)
        assert got.code is RejectCode.TOKEN_OUT_OF_RANGE
        assert got.message == f"token_ids[{n - 1}] = 1000 is outside [0, 1000)"
        got = refused(prefill_map(token_ids=pack_tokens([-1, *prompt])), limits)
        assert got.message == "token_ids[0] = -1 is outside [0, 1000)"


@pytest.mark.parametrize("deadline", [0, 0.0, -1.0, float("nan"), float("inf")])
def test_a_deadline_of_0_or_not_finite_is_refused(deadline: float) -> None:
    got = refused(prefill_map(deadline_s=deadline))
    assert got.code is RejectCode.BAD_FIELD and got.field == "deadline_s"


def test_the_smallest_positive_deadline_passes() -> None:
    got = decode(prefill_map(deadline_s=5e-324))
    assert isinstance(got, PrefillRequest) and got.deadline_s == 5e-324


def test_a_request_id_of_exactly_the_maximum_length_passes_and_is_named_in_rejects() -> None:
    longest = "x" * MAX_REQUEST_ID_CHARS
    got = decode(prefill_map(request_id=longest))
    assert isinstance(got, PrefillRequest) and got.request_id == longest
    reject = refused(prefill_map(request_id=longest, token_ids=b""))
    assert reject.code is RejectCode.EMPTY_PROMPT and reject.request_id == longest
    too_long = refused(prefill_map(request_id=longest + "x", token_ids=b""))
    assert too_long.field == "request_id" and not too_long.request_id


def test_a_reject_for_another_field_still_names_a_valid_request_id() -> None:
    got = refused(prefill_map(token_ids=b""))
    assert got.code is RejectCode.EMPTY_PROMPT and got.request_id == "r-1"
    got = refused(prefill_map(request_id=7, token_ids=b""))  # not a string: no id to name
    assert not got.request_id


# ── the container cap, on each msgpack header ───────────────────────────────────────────────


def array16(items: list[int]) -> bytes:
    return b"\xdc" + len(items).to_bytes(2, "big") + b"".join(msgpack.packb(i) for i in items)


def array32(items: list[int]) -> bytes:
    return b"\xdd" + len(items).to_bytes(4, "big") + b"".join(msgpack.packb(i) for i in items)


def frame_with(key: str, packed_value: bytes, extra: dict[str, Any] | None = None) -> bytes:
    """A valid prefill map with one more key whose value is ``packed_value`` as given."""
    m = prefill_map(**(extra or {}))
    body = b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in m.items())
    header = len(m) + 1
    assert header <= 15
    return bytes([0x80 | header]) + body + msgpack.packb(key) + packed_value


@pytest.mark.parametrize("pack", [array16, array32], ids=["array16", "array32"])
def test_an_unknown_key_may_hold_exactly_the_cap_and_not_one_more(pack: Any) -> None:
    assert isinstance(decode(frame_with("extra", pack([1] * CAP))), PrefillRequest)
    assert isinstance(decode(frame_with("extra", pack([1, 2, 3]))), PrefillRequest)
    assert refused(frame_with("extra", pack([1] * (CAP + 1)))).code is RejectCode.MALFORMED


def test_a_map16_value_is_counted_too() -> None:
    items = {f"k{i}": i for i in range(CAP)}
    ok = b"\xde" + CAP.to_bytes(2, "big") + msgpack.packb(items)[3:]
    assert isinstance(decode(frame_with("extra", ok)), PrefillRequest)
    items[f"k{CAP}"] = CAP
    over = msgpack.packb(items)
    assert over[0] == 0xDE and refused(frame_with("extra", over)).code is RejectCode.MALFORMED


def test_a_map32_value_is_counted_too() -> None:
    items = {f"k{i}": i for i in range(CAP + 1)}
    over = b"\xdf" + (CAP + 1).to_bytes(4, "big") + msgpack.packb(items)[3:]
    assert refused(frame_with("extra", over)).code is RejectCode.MALFORMED


def test_a_top_level_map_of_exactly_the_cap_passes_and_one_more_is_malformed() -> None:
    m = prefill_map()
    m.update({f"x{i}": 0 for i in range(CAP - len(m))})
    assert len(m) == CAP and isinstance(decode(m), PrefillRequest)
    m["one_more"] = 0
    assert refused(m).code is RejectCode.MALFORMED


@pytest.mark.parametrize("frame", [b"", b"\xdc", b"\xdc\x00", b"\xdd\x00\x00\x00", b"\xde\x00"])
def test_a_truncated_header_is_malformed(frame: bytes) -> None:
    assert refused(frame).code is RejectCode.MALFORMED
