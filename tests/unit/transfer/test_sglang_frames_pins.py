"""Pins for SGLang frame parsing: behaviours that mutation testing (`make mutation`,
scripts/mutation.py) found no test held. A hostile or broken decode's frame is refused with a
``FrameError`` whose text names the field and the bytes at fault (the log line an operator
reads), every bound is inclusive where SGLang's values reach it, and no other exception
escapes."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest

from prefill_worker.transfer.sglang import frames
from prefill_worker.transfer.sglang.frames import (
    AbortNotice,
    FrameError,
    Registration,
    TransferRequest,
    check_nixl_metadata,
    parse,
)

CAPTURED = json.loads((Path(__file__).parent / "sglang_frames.json").read_text())


def captured(kind: str) -> list[bytes]:
    return [base64.b64decode(f) for f in CAPTURED["0.5.23"][kind]]


def changed(kind: str, **frames_at: bytes) -> list[bytes]:
    """The captured 0.5.23 message with frames replaced: ``f9=b"3"`` sets frame 9."""
    message = captured(kind)
    for key, value in frames_at.items():
        message[int(key[1:])] = value
    return message


def registration(**frames_at: bytes) -> Registration:
    reg = parse(changed("registration", **frames_at))
    assert isinstance(reg, Registration)
    return reg


def request(**frames_at: bytes) -> TransferRequest:
    req = parse(changed("request", **frames_at))
    assert isinstance(req, TransferRequest)
    return req


def refusal(message: list[bytes]) -> str:
    with pytest.raises(FrameError) as error:
        parse(message)
    return str(error.value)


def not_int(what: str, raw: bytes = b"x") -> str:
    return f"{what} is not a decimal integer: {raw!r}"


@pytest.mark.parametrize(
    ("kind", "index", "what"),
    [
        ("registration", 9, "gpu_id"),
        ("registration", 10, "tp_size"),
        ("registration", 11, "tp_rank"),
        ("registration", 12, "kv_item_len"),
        ("registration", 17, "num_slots"),
        ("registration", 22, "dcp_size"),
        ("request", 1, "room"),
        ("request", 6, "aux_index"),
        ("request", 7, "required_dst_info_num"),
        ("request", 9, "decode_prefix_len"),
        ("request", 10, "is_dummy"),
        ("abort", 1, "room"),
        ("abort", 4, "generation"),
    ],
)
def test_a_bad_integer_names_its_field(kind: str, index: int, what: str) -> None:
    assert refusal(changed(kind, **{f"f{index}": b"x"})) == not_int(what)


@pytest.mark.parametrize(
    ("index", "raw", "message"),
    [
        (6, b"\x00" * 7, "kv_ptrs is not packed uint64 (7 bytes)"),
        (7, b"\x00" * 9, "aux_ptrs is not packed uint64 (9 bytes)"),
        (19, b"\x00" * 4, "kv_item_lens is not packed uint64 (4 bytes)"),
        (21, b"\x00" * 5, "kv_layer_ids is not packed uint32 (5 bytes)"),
        (21, b"\x00" * 6, "kv_layer_ids is not packed uint32 (6 bytes)"),
    ],
)
def test_a_bad_packed_list_names_its_field_and_length(index: int, raw: bytes, message: str) -> None:
    assert refusal(changed("registration", **{f"f{index}": raw})) == message


def test_the_registrations_fields_are_read_from_their_frames() -> None:
    reg = registration(f9=b"3", f12=b"1", f17=b"1", f21=struct.pack("<2I", 0, 1))
    assert (reg.gpu_id, reg.tp_size, reg.kv_item_len, reg.num_slots) == (3, 1, 1, 1)
    assert reg.kv_layer_ids == (0, 1)
    assert registration(f18=b"", f19=b"").mem_kinds == ()  # no kinds sent: none assumed
    assert registration(f18=b"").mem_kinds == ()
    assert registration(f22=b"").dcp_size == 1  # older decodes leave it empty
    assert registration(f22=b"2", f23=b"").dcp_size == 2


def test_state_frames_mark_a_hybrid_registration() -> None:
    """The state fields themselves are ``test_sglang_state_frames``'s."""
    one = packed_lists([7], fmt="Q")
    assert registration(f8=one, f13=packed_lists([64], fmt="I")).has_state
    assert not registration().has_state
    assert not registration(f8=struct.pack("<I", 0)).has_state  # no components
    for index in (8, 13, 14, 20, 24):  # one byte is no packed list: refused, not guessed
        message = changed("registration", **{f"f{index}": b"\x01"})
        assert "is truncated (1 bytes)" in refusal(message)


@pytest.mark.parametrize(("f15", "f16"), [(b"\x01", b""), (b"", b"\x01")])
def test_either_staging_frame_marks_staging(f15: bytes, f16: bytes) -> None:
    assert registration(f15=f15, f16=f16).has_staging
    assert not registration().has_staging


def test_integer_bounds_are_inclusive() -> None:
    top_room = frames.MAX_ROOM - 1
    req = request(f1=b"%d" % top_room, f3=b"65535", f6=b"%d" % (2**31 - 1), f9=b"0", f10=b"1")
    assert (req.room, req.endpoint.port, req.aux_index, req.decode_prefix_len) == (
        top_room,
        65535,
        2**31 - 1,
        0,
    )
    assert req.is_dummy
    req = request(f1=b"0", f3=b"1", f6=b"0", f9=b"%d" % (2**31 - 1))
    assert (req.room, req.endpoint.port, req.aux_index, req.decode_prefix_len) == (
        0,
        1,
        0,
        2**31 - 1,
    )
    abort = parse(changed("abort", f4=b"0"))
    assert isinstance(abort, AbortNotice) and abort.generation == 0


@pytest.mark.parametrize(
    ("index", "raw", "message"),
    [
        (
            1,
            b"%d" % frames.MAX_ROOM,
            f"room {frames.MAX_ROOM} is outside [0, {frames.MAX_ROOM - 1}]",
        ),
        (3, b"0", "port 0 is outside [1, 65535]"),
        (3, b"65536", "port 65536 is outside [1, 65535]"),
        (6, b"%d" % 2**31, f"aux_index {2**31} is outside [0, {2**31 - 1}]"),
        (9, b"%d" % 2**31, f"decode_prefix_len {2**31} is outside [0, {2**31 - 1}]"),
        (7, b"0", f"required_dst_info_num 0 is outside [1, {2**64 - 1}]"),
    ],
)
def test_an_integer_out_of_bounds_names_them(index: int, raw: bytes, message: str) -> None:
    assert refusal(changed("request", **{f"f{index}": raw})) == message


def test_long_bad_values_are_shown_cut_short() -> None:
    assert refusal(changed("request", f1=b"9" * 30 + b"x")) == not_int("room", b"9" * 24)
    host = b"h" * 50
    assert refusal(changed("request", f2=host)) == f"ip {'h' * 40!r} is not an IP address"
    assert refusal([b"T" * 30]) == f"frame 0 is {b'T' * 20!r}, not a known tag"


def test_agent_names_are_1_to_255_ascii_bytes() -> None:
    assert request(f4=b"a").agent_name == "a"
    assert request(f4=b"a" * 255).agent_name == "a" * 255
    assert refusal(changed("request", f4=b"a" * 256)) == (
        "agent_name must be 1..255 bytes, not 256"
    )
    assert refusal(changed("request", f4="dé".encode())) == "agent_name is not ASCII"


def test_short_messages_are_refused_as_what_they_start() -> None:
    assert refusal([]) == "an empty message"
    assert refusal([frames.GUARD]) == "a transfer request has 11 frames, this one has 1"
    assert refusal([frames.GUARD, b"None"]) == (
        "a registration has 24 or 25 frames, this one has 2"
    )


def packed_lists(*lists: list[int], fmt: str = "i") -> bytes:
    """SGLang's ``pack_int_lists``: u32 count, u32 byte lengths, then the values."""
    width = struct.calcsize(fmt)
    values = [v for lst in lists for v in lst]
    lens = [width * len(lst) for lst in lists]
    return struct.pack(f"<I{len(lists)}I{len(values)}{fmt}", len(lists), *lens, *values)


def test_state_indices_are_read_as_sglang_packs_them() -> None:
    assert not request(f8=struct.pack("<I", 0)).has_state  # no lists
    assert not request(f8=struct.pack("<III", 2, 0, 0)).has_state  # lists, all empty
    req = request(f8=packed_lists([], [5, -1, 7]))
    assert req.has_state and req.state_indices == ((), (5, -1, 7))
    assert request(f8=packed_lists([1], [])).has_state
    for truncated in (b"\x01\x00", struct.pack("<II", 3, 0), b"\xff\xff\xff\xff"):
        assert "state_indices" in refusal(changed("request", f8=truncated))
    assert refusal(changed("request", f8=struct.pack("<II", 1, 5))) == (
        "state_indices: its lists' lengths add up to 5 bytes, it carries 0"
    )


def nixl_metadata(name: bytes, length: int | None = None) -> bytes:
    size = len(name) if length is None else length
    return b"nixlSerDes|Agent" + struct.pack("<Q", size) + name + b"|rest"


def test_metadata_must_name_the_agent_exactly() -> None:
    blob = nixl_metadata(b"abc")
    assert check_nixl_metadata(blob, "abc", len(blob)) is None  # exactly at the size bound
    assert check_nixl_metadata(blob, "abc", len(blob) - 1) == (
        f"agent metadata of {len(blob)} bytes exceeds {len(blob) - 1}"
    )
    assert check_nixl_metadata(nixl_metadata(b"abd"), "abc", 1 << 20) == (
        "agent metadata does not name agent 'abc'"
    )
    assert check_nixl_metadata(nixl_metadata(b"abc", 4), "abc", 1 << 20) is not None
    header_only = b"nixlSerDes|Agent" + struct.pack("<Q", 3)
    assert check_nixl_metadata(header_only, "abc", 1 << 20) == (
        "agent metadata does not name agent 'abc'"
    )
    for short in (b"nixlSerDes|Agent\x03", b"nixlSerDes|Agent" + b"\x03" * 7):
        assert check_nixl_metadata(short, "abc", 1 << 20) == (
            "agent metadata is not a NIXL metadata blob"
        )


def test_a_reason_that_utf8_cannot_carry_is_sent_replaced() -> None:
    assert frames.kv_status(3, False, "bad \ud800 name")[-1] == b"bad ? name"
