"""The bootstrap protocol codec and the metadata frame: round trips, and refusals that name
what is wrong."""

from __future__ import annotations

import contextlib
import re

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire

LAYOUT = KVLayout(2, 4, 64, "bfloat16", 16, 100)
REGIONS = KVRegions(LAYOUT, (1 << 40, 2 << 40), (3 << 40, 4 << 40), "cuda:1", 5 << 40, 64)

MESSAGES: list[wire.Message] = [
    wire.Register.of("decode-a", wire.frame_metadata(b"md"), REGIONS, LAYOUT.compat_hash()),
    wire.Want.of(2**63 - 1, (5, 0, 99), 3, 32),
    wire.Abort(7),
    wire.Heartbeat(),
    wire.Bye(),
    wire.Registered(
        is_ok=False,
        reason="layout mismatch",
        agent_name="prefill-x",
        heartbeat_interval_s=1.0,
        peer_timeout_s=10.0,
    ),
    wire.Status(9, "failed", "peer silent"),
    wire.Status(9, "ok"),
    wire.Status(9, "failed", "decode peer not registered", "unknown_peer"),
    wire.Reject("bad"),
    wire.UnknownPeer("decode peer not registered"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg)) == msg


@given(
    room=st.integers(0, 2**63 - 1),
    pages=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    slot=st.integers(0, 2**31),
    cached=st.integers(0, 2**31),
)
def test_want_round_trip(room: int, pages: list[int], slot: int, cached: int) -> None:
    msg = wire.Want.of(room, tuple(pages), slot, cached)
    assert wire.decode(wire.encode(msg)) == msg


def test_page_ids_travel_packed_int32() -> None:
    body = msgpack.unpackb(wire.encode(wire.Want.of(1, (1, 2, 3), 0, 0)))
    assert body["v"] == 1 and body["type"] == "want"
    assert body["dst_page_ids"] == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"


def _raw(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b"\xc1", "not a msgpack message: MessagePack data is malformed"),
        (_raw(v=1), "Object missing required field `type`"),
        (msgpack.packb([1, 2]), "Expected `object`, got `array`"),
        (_raw(v=2, type="abort", room=1), "Invalid enum value 2 - at `$.v`"),
        (_raw(v=1, type="nope"), "Invalid value 'nope' - at `$.type`"),
        (_raw(v=1, type="abort"), "Object missing required field `room`"),
        (_raw(v=1, type="abort", room="x"), "Expected `int`, got `str` - at `$.room`"),
        (_raw(v=1, type="abort", room=True), "Expected `int`, got `bool` - at `$.room`"),
        (
            _raw(
                v=1, type="want", room=1, dst_page_ids=b"abc", dst_aux_slot=0, num_cached_tokens=0
            ),
            "dst_page_ids is not packed int32 (3 bytes) - at `$.dst_page_ids`",
        ),
        (
            _raw(v=1, type="want", room=1, dst_page_ids=[1, 2], dst_aux_slot=0),
            "Expected `bytes`, got `array` - at `$.dst_page_ids`",
        ),
        (
            _raw(v=1, type="status", room=1, status="maybe"),
            "Invalid enum value 'maybe' - at `$.status`",
        ),
    ],
)
def test_bad_messages_name_the_problem(frame: bytes, why: str) -> None:
    with pytest.raises(wire.WireError, match=re.escape(why)):
        wire.decode(frame)


def test_register_checks_the_layout_fields() -> None:
    good = msgpack.unpackb(wire.encode(MESSAGES[0]))
    for key, value, why in [
        ("dtype", "int7", "Invalid enum value 'int7' - at `$.layout.dtype`"),
        ("num_pages", 0, "Expected `int` >= 1 - at `$.layout.num_pages`"),
        ("head_dim", "64", "Expected `int`, got `str` - at `$.layout.head_dim`"),
    ]:
        body = dict(good, layout=dict(good["layout"], **{key: value}))
        with pytest.raises(wire.WireError, match=re.escape(why)):
            wire.decode(msgpack.packb(body, use_bin_type=True))
    for body, why in [
        (dict(good, k_base_addrs=[1]), "one address per layer needed (2 layers, got 1 and 2)"),
        (dict(good, v_base_addrs=[1, "x"]), "Expected `int`, got `str` - at `$.v_base_addrs[1]`"),
        (dict(good, num_aux_rows=0), "Expected `int` >= 1 - at `$.num_aux_rows`"),
    ]:
        with pytest.raises(wire.WireError, match=re.escape(why)):
            wire.decode(msgpack.packb(body, use_bin_type=True))


def test_register_carries_regions_as_kv_regions() -> None:
    msg = wire.decode(wire.encode(MESSAGES[0]))
    assert isinstance(msg, wire.Register) and msg.regions == REGIONS


def test_want_page_ids_stay_packed_until_looked_at() -> None:
    """The DoS fix of issue 12: decoding a want never makes a Python list of its page ids."""
    msg = wire.decode(wire.encode(wire.Want.of(4, range(512), 0, 0)))
    assert isinstance(msg, wire.Want) and isinstance(msg.packed_dst_page_ids, bytes)
    assert msg.num_dst_pages == 512
    view = msg.dst_page_ids
    assert view.dtype == np.dtype("<i4") and not view.flags.writeable
    assert view.tolist() == list(range(512))


def test_unknown_extra_fields_are_ignored() -> None:
    assert wire.decode(_raw(v=1, type="abort", room=3, extra="x")) == wire.Abort(3)


@given(st.binary(max_size=2000))
def test_frame_round_trip(payload: bytes) -> None:
    assert wire.unframe_metadata(wire.frame_metadata(payload)) == payload


@given(st.binary(min_size=1, max_size=500), st.data())
def test_any_single_byte_flip_or_cut_is_refused(payload: bytes, data: st.DataObject) -> None:
    frame = wire.frame_metadata(payload)
    i = data.draw(st.integers(0, len(frame) - 1))
    flipped = frame[:i] + bytes([frame[i] ^ data.draw(st.integers(1, 255))]) + frame[i + 1 :]
    with pytest.raises(wire.WireError):
        wire.unframe_metadata(flipped)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(wire.WireError):
        wire.unframe_metadata(frame[:cut])


def test_frame_errors_say_why() -> None:
    frame = wire.frame_metadata(b"x" * 100)
    with pytest.raises(wire.WireError, match="truncated"):
        wire.unframe_metadata(frame[:10])
    with pytest.raises(wire.WireError, match="length mismatch"):
        wire.unframe_metadata(frame[:-1])
    with pytest.raises(wire.WireError, match="checksum"):
        wire.unframe_metadata(frame[:-1] + b"y")
    with pytest.raises(wire.WireError, match="magic"):
        wire.unframe_metadata(b"ABCD" + frame[4:])


def test_status_code_is_optional_on_the_wire() -> None:
    """v1 peers that know no ``code`` send and read statuses as before."""
    plain = msgpack.unpackb(wire.encode(wire.Status(3, "failed", "x")))
    assert "code" not in plain
    old = msgpack.packb({"v": 1, "type": "status", "room": 3, "status": "failed", "reason": "x"})
    assert wire.decode(old) == wire.Status(3, "failed", "x")


def test_status_traceparent_is_optional_on_the_wire() -> None:
    """Added with request tracing: left out when unset, read when present, and a status
    without it (an older worker's) still decodes."""
    assert "traceparent" not in msgpack.unpackb(wire.encode(wire.Status(3, "ok")))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = wire.Status(3, "ok", traceparent=parent)
    assert msgpack.unpackb(wire.encode(traced))["traceparent"] == parent
    assert wire.decode(wire.encode(traced)) == traced
    old = msgpack.packb({"v": 1, "type": "status", "room": 3, "status": "ok", "reason": None})
    assert wire.decode(old).traceparent is msgspec.UNSET


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_wire_error(frame: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(frame)


@given(
    st.dictionaries(
        st.one_of(st.sampled_from(["v", "type", "room", "reason", "status"]), st.integers(0, 9)),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.sampled_from(["abort", "status", "reject", "ok", "failed"]),
            st.text(max_size=8),
            st.none(),
            st.binary(),
        ),
    )
)
def test_any_map_decodes_or_raises_wire_error(body: dict[object, object]) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(msgpack.packb(body, use_bin_type=True))


def test_notif_tag_is_the_v1_bytes_for_every_room() -> None:
    """The worker sends this tag with a room's aux row and the decode SDK waits for it: both
    sides of v1 must compute the same bytes, and no two rooms may share one."""
    assert wire.notif_tag(0) == b"pw1:room:0"
    assert wire.notif_tag(2**63 - 1) == b"pw1:room:9223372036854775807"
    assert len({wire.notif_tag(room) for room in (1, 10, 11, 101, 110)}) == 5
