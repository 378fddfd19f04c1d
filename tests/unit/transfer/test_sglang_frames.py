"""SGLang's control frames: the ones SGLang's own decode sent (0.5.20, 0.5.22, 0.5.23, captured
in sglang_frames.json) parse to what they say; anything else is a ``FrameError``, never another
exception; the replies are what SGLang's decode parses."""

from __future__ import annotations

import base64
import contextlib
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_worker.transfer.sglang import frames
from prefill_worker.transfer.sglang.frames import (
    AbortNotice,
    Endpoint,
    FrameError,
    Registration,
    TransferRequest,
    check_nixl_metadata,
    parse,
)

CAPTURED = json.loads((Path(__file__).parent / "sglang_frames.json").read_text())
VERSIONS = [v for v in CAPTURED if v != "note"]


def captured(version: str, kind: str) -> list[bytes]:
    return [base64.b64decode(f) for f in CAPTURED[version][kind]]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_registration_from_each_version(version: str) -> None:
    reg = parse(captured(version, "registration"))
    assert isinstance(reg, Registration)
    assert reg.endpoint.host == "127.0.0.1" and 0 < reg.endpoint.port < 65536
    assert len(reg.kv_ptrs) == 4 and all(reg.kv_ptrs)  # 2 layers: K0 K1 V0 V1
    assert len(reg.aux_ptrs) == 10
    assert (reg.tp_size, reg.tp_rank, reg.dcp_size) == (1, 0, 1)
    assert reg.kv_item_len == 4 * 2 * 16 * 4  # page 4 x 2 heads x 16 dims x fp32
    assert reg.kv_item_lens == (reg.kv_item_len,) * 4
    assert reg.num_slots == 17  # 64 tokens / 4 + SGLang's padding page
    assert reg.mem_kinds == ("DRAM",) * 4
    assert not reg.has_state and not reg.has_staging and reg.kv_layer_ids == ()
    assert check_nixl_metadata(reg.agent_metadata, reg.agent_name, 1 << 20) is None


@pytest.mark.parametrize("version", VERSIONS)
def test_a_transfer_request_from_each_version(version: str) -> None:
    req = parse(captured(version, "request"))
    assert isinstance(req, TransferRequest)
    reg = parse(captured(version, "registration"))
    assert isinstance(reg, Registration)
    assert (req.room, req.aux_index, req.decode_prefix_len) == (1234, 2, 4)
    assert (req.agent_name, req.endpoint) == (reg.agent_name, reg.endpoint)
    assert (req.required_dst_info_num, req.is_dummy, req.has_state) == (1, False, False)
    want = req.want()
    assert list(want.dst_page_ids) == [3, 5, 7]
    assert (want.room, want.dst_aux_slot, want.num_cached_tokens) == (1234, 2, 4)


@pytest.mark.parametrize("version", VERSIONS)
def test_an_abort_from_each_version(version: str) -> None:
    abort = parse(captured(version, "abort"))
    assert isinstance(abort, AbortNotice) and abort.room == 1234
    # 0.5.20 sends no generation; later versions arm one per abort and expect it back.
    assert (abort.generation is None) == (version == "0.5.20")


def test_replies_are_what_sglang_parses() -> None:
    assert frames.kv_status(42, True, None) == [b"KV_STATUS", b"42", b"4", b"0", b""]
    assert frames.kv_status(42, False, "no") == [b"KV_STATUS", b"42", b"0", b"0", b"no"]
    assert frames.abort_ack(42, 7) == [b"ABORT_ACK", b"42", b"0", b"7"]
    assert frames.abort_ack(42, None) == [b"ABORT_ACK", b"42", b"0"]
    assert Endpoint("::1", 5).address == "tcp://[::1]:5"


def test_bad_frames_say_which_frame() -> None:
    request = captured("0.5.23", "request")
    cases = {
        "room": [*request[:1], b"12x", *request[2:]],
        "page_ids": [*request[:5], b"\x01\x02\x03", *request[6:]],
        "port": [*request[:3], b"70000", *request[4:]],
        "is_dummy": [*request[:10], b"2"],
        "11 frames": request[:9],
        "not a known tag": [b"HELLO", *request[1:]],
        "ABORT": [b"ABORT", b"1"],
        "agent_name": [*request[:4], b"", *request[5:]],
        "state_indices": [*request[:8], b"\x05", *request[9:]],
    }
    for what, message in cases.items():
        with pytest.raises(FrameError, match=what):
            parse(message)
    registration = captured("0.5.23", "registration")
    with pytest.raises(FrameError, match="kv_ptrs"):
        parse([*registration[:6], b"\x00" * 7, *registration[7:]])
    with pytest.raises(FrameError, match="24 or 25"):
        parse(registration[:20])


def test_metadata_must_name_the_agent() -> None:
    reg = parse(captured("0.5.23", "registration"))
    assert isinstance(reg, Registration)
    md = reg.agent_metadata
    assert "does not name" in str(check_nixl_metadata(md, "someone-else", 1 << 20))
    assert "not a NIXL" in str(check_nixl_metadata(b"garbage" + md, reg.agent_name, 1 << 20))
    assert "exceeds" in str(check_nixl_metadata(md, reg.agent_name, 100))
    lying = md[:16] + struct.pack("<Q", 2**60) + md[24:]
    assert check_nixl_metadata(lying, reg.agent_name, 1 << 20) is not None


@given(st.lists(st.binary(max_size=40), max_size=30))
def test_any_frames_parse_or_raise_frame_error(message: list[bytes]) -> None:
    with contextlib.suppress(FrameError):  # any other exception fails the property
        parse(message)


@given(st.integers(0, 29), st.binary(max_size=24))
def test_a_captured_frame_changed_parses_or_raises_frame_error(index: int, junk: bytes) -> None:
    for kind in ("registration", "request", "abort"):
        message = captured("0.5.23", kind)
        if index < len(message):
            message[index] = junk
        with contextlib.suppress(FrameError):
            parse(message)


@pytest.mark.parametrize("host", [b"decode-7.invalid", b"localhost", b"10.0.0.1.nip.io"])
def test_a_host_name_is_refused_never_resolved(host: bytes) -> None:
    """Resolving a name can block for seconds; decodes send their IP address."""
    with pytest.raises(FrameError, match="is not an IP address"):
        parse([frames.ABORT_TAG, b"7", host, b"9000", b"1"])
    abort = parse([frames.ABORT_TAG, b"7", b"::1", b"9000", b"1"])
    assert isinstance(abort, AbortNotice) and abort.endpoint.host == "::1"
