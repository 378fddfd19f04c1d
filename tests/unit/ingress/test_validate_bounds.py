"""The router ingress at its exact boundaries: the last value that passes and the first that
is refused, and the msgpack headers the container cap reads (found unpinned by mutation
testing, `make mutation`)."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
from msgspec import UNSET

from prefill_worker.ingress.messages import MAX_REQUEST_ID_CHARS, Reject, RejectCode, pack_tokens
from prefill_worker.ingress.validate import Limits, PromptRefused, check_token_ids, decode_router
from prefill_worker.request import PrefillRequest
from tests.unit.ingress.test_messages import prefill_map

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
    got = refused(prefill_map(request_id="r", token_ids=b""))  # the shortest id
    assert got.code is RejectCode.EMPTY_PROMPT and got.request_id == "r"


@pytest.mark.parametrize("request_id", [7, "", None])
def test_an_invalid_or_missing_request_id_is_not_named_when_another_field_fails_first(
    request_id: object,
) -> None:
    """msgspec stops at the first bad field in map order: here ``sampling``, before the id."""
    m: dict[str, Any] = {"v": 1, "type": "prefill", "sampling": "bad", "request_id": request_id}
    if request_id is None:
        del m["request_id"]
    got = refused({**m, "token_ids": b"", "bootstrap_room": 1})
    assert got.code is RejectCode.BAD_FIELD and got.field == "sampling"
    assert got.request_id is UNSET


def test_only_a_prefill_reject_names_a_request_id() -> None:
    got = refused({"v": 1, "type": "ping", "nonce": "x", "request_id": "r-1"})
    assert got.field == "nonce" and got.request_id is UNSET


# ── the words of each reject ────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("m", "code", "field", "message"),
    [
        ({"type": "prefill"}, RejectCode.MISSING_FIELD, "v", "v is required"),
        ({"v": 2, "type": "prefill"}, RejectCode.BAD_VERSION, "v", "v must be 1, got 2"),
        ({"v": 1}, RejectCode.MISSING_FIELD, "type", "type is required"),
        ({"v": 1, "type": 3}, RejectCode.BAD_FIELD, "type", "type must be a string"),
        (
            prefill_map(deadline_s=0),
            RejectCode.BAD_FIELD,
            "deadline_s",
            "deadline_s must be > 0",
        ),
        (
            prefill_map(token_ids=b"\x01" * 5),
            RejectCode.BAD_FIELD,
            "token_ids",
            "token_ids must be packed little-endian int32 bytes",
        ),
        (prefill_map(token_ids=b""), RejectCode.EMPTY_PROMPT, "token_ids", "token_ids is empty"),
        (
            prefill_map(token_ids=pack_tokens([1] * 65)),
            RejectCode.PROMPT_TOO_LONG,
            "token_ids",
            "token_ids has 65 tokens, over max_prompt_tokens=64",
        ),
        (
            prefill_map(sampling={"top_k": "x"}),
            RejectCode.BAD_FIELD,
            "sampling.top_k",
            "sampling.top_k: Expected `int`, got `str`",
        ),
    ],
)
def test_each_reject_says_what_is_wrong(
    m: dict[str, Any], code: RejectCode, field: str, message: str
) -> None:
    got = refused(m)
    assert (got.code, got.field, got.message) == (code, field, message)


def test_a_malformed_frame_names_no_field() -> None:
    got = refused(b"\xc1")
    assert got.code is RejectCode.MALFORMED and got.field is UNSET


def utf8_broken(key: str) -> bytes:
    """A prefill frame whose ``key`` holds a msgpack str that is not UTF-8."""
    items = [(k, msgpack.packb(v, use_bin_type=True)) for k, v in prefill_map().items() if k != key]
    items.append((key, b"\xa2\xff\xfe"))
    return bytes([0x80 | len(items)]) + b"".join(msgpack.packb(k) + v for k, v in items)


@pytest.mark.parametrize("key", ["v", "type", "request_id"])
def test_a_string_that_is_not_utf8_is_malformed(key: str) -> None:
    got = refused(utf8_broken(key))
    assert got.code is RejectCode.MALFORMED and got.field is UNSET
    assert got.message.startswith("frame is not a msgpack map")


def test_a_prompt_without_a_seed_samples_without_one() -> None:
    # a temperature never sent before: admission caches checked sampling settings by value
    temperature = 0.5 + random.random() / 4
    got = decode(prefill_map(sampling={"temperature": temperature}))
    assert isinstance(got, PrefillRequest) and got.sampling.seed is None


def test_the_first_token_out_of_range_is_named_after_in_range_zeros() -> None:
    got = refused(prefill_map(token_ids=pack_tokens([0, 0, 1000, 5])))
    assert got.message == "token_ids[2] = 1000 is outside [0, 1000)"


# ── check_token_ids: the same policy for the HTTP front ─────────────────────────────────────


def test_check_token_ids_takes_a_valid_prompt_as_int32() -> None:
    packed = check_token_ids([0, 5, 999], LIMITS)
    assert packed.typecode == "i" and list(packed) == [0, 5, 999]


@pytest.mark.parametrize(
    ("token_ids", "code", "message"),
    [
        ([1, 2**40], RejectCode.TOKEN_OUT_OF_RANGE, "token_ids hold a value outside [0, 1000)"),
        ([3, -1], RejectCode.TOKEN_OUT_OF_RANGE, "token_ids[1] = -1 is outside [0, 1000)"),
        ([], RejectCode.EMPTY_PROMPT, "token_ids is empty"),
        (
            [1] * 49,
            RejectCode.PROMPT_TOO_LONG,
            "token_ids has 49 tokens, more than the KV pool holds (48)",
        ),
    ],
)
def test_check_token_ids_refuses_with_the_code_and_words_of_a_frame(
    token_ids: list[int], code: RejectCode, message: str
) -> None:
    with pytest.raises(PromptRefused) as refusal:
        check_token_ids(token_ids, LIMITS)
    assert (refusal.value.code, str(refusal.value)) == (code, message)


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


def test_a_16_bit_count_is_read_from_both_bytes() -> None:
    """320 items: 0x0140, whose low byte alone (64) would pass the cap."""
    assert refused(frame_with("extra", array16([1] * 320))).code is RejectCode.MALFORMED


def test_a_32_bit_count_is_read_from_all_four_bytes() -> None:
    """2**24 + 1 items: the low three bytes alone say 1."""
    count = 2**24 + 1
    huge = b"\xdd" + count.to_bytes(4, "big") + b"\x01" * count
    assert refused(frame_with("extra", huge)).code is RejectCode.MALFORMED


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
