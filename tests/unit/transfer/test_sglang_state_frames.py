"""The state fields of SGLang's frames (``sglang.state_frames``): read as SGLang 0.5.23's decode
packs them (``pack_int_lists``: u32 count, u32 byte lengths, values), one record per component;
anything else a ``FrameError`` naming the field, never another exception."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_worker.transfer.sglang.frames import FrameError, Registration, TransferRequest, parse
from prefill_worker.transfer.sglang.state_frames import (
    MAX_COMPONENTS,
    StateBuffers,
    StateFrameError,
    unpack_lists,
)
from tests.unit.transfer.test_sglang_frames_pins import changed, packed_lists


def swa_registration(**frames_at: bytes) -> Registration:
    """0.5.23's registration from a decode with a hybrid SWA pool of 2 sliding layers: K and
    V of each (4 buffers of 64-byte pages, 33 of them), no dims, no layer ids."""
    ptrs, lens = [0x1000, 0x2000, 0x3000, 0x4000], [64] * 4
    state = {
        "f8": packed_lists(ptrs, fmt="Q"),
        "f13": packed_lists(lens, fmt="I"),
        "f14": packed_lists([], fmt="I"),
        "f20": packed_lists([], fmt="I"),
        "f24": packed_lists([64 * 33] * 4, fmt="Q"),
    }
    reg = parse(changed("registration", **{**state, **frames_at}))
    assert isinstance(reg, Registration)
    return reg


def test_a_swa_registration_is_one_component() -> None:
    reg = swa_registration()
    assert reg.has_state
    assert reg.state == (
        StateBuffers((0x1000, 0x2000, 0x3000, 0x4000), (64,) * 4, (64 * 33,) * 4, (), ()),
    )


def test_a_decode_before_0_5_23_sends_no_data_lens() -> None:
    frames = changed("registration")[:24]
    state = [packed_lists([8], fmt="Q"), packed_lists([4], fmt="I")]
    frames[8], frames[13] = state
    reg = parse(frames)
    assert isinstance(reg, Registration)
    assert reg.state == (StateBuffers((8,), (4,), (), (), ()),)


def test_two_components_keep_their_order() -> None:
    reg = swa_registration(
        f8=packed_lists([1, 2], [3], fmt="Q"),
        f13=packed_lists([10, 20], [30], fmt="I"),
        f14=packed_lists([], [5], fmt="I"),
        f20=packed_lists([], [7], fmt="I"),
        f24=packed_lists([100, 200], [300], fmt="Q"),
    )
    assert [s.data_ptrs for s in reg.state] == [(1, 2), (3,)]
    assert [s.dims for s in reg.state] == [(), (5,)]
    assert [s.layer_ids for s in reg.state] == [(), (7,)]


@pytest.mark.parametrize(
    ("frames_at", "message"),
    [
        ({"f13": packed_lists([64], [64], fmt="I")}, "state_item_lens has 2 lists"),
        ({"f24": packed_lists([1], [2], fmt="Q")}, "state_data_lens has 2 lists"),
        ({"f14": packed_lists([], [], fmt="I")}, "state_dims has 2 lists"),
        ({"f20": packed_lists([], [], fmt="I")}, "state_layer_ids has 2 lists"),
        ({"f13": b""}, "state buffers registered without state_item_lens"),
        ({"f8": packed_lists([1], fmt="I")}, "state_data_ptrs: a list of 4 bytes is not whole Q"),
    ],
)
def test_fields_that_disagree_are_refused(frames_at: dict[str, bytes], message: str) -> None:
    with pytest.raises(FrameError, match=message):
        swa_registration(**frames_at)


def test_the_request_names_the_window_pages() -> None:
    req = parse(changed("request", f8=packed_lists([9, 4, 12])))
    assert isinstance(req, TransferRequest)
    assert req.has_state and req.state_indices == ((9, 4, 12),)
    assert req.want().num_dst_pages == 3  # the KV pages are unchanged


def test_counts_are_bounded() -> None:
    lists = [[i] for i in range(MAX_COMPONENTS)]
    assert len(unpack_lists(packed_lists(*lists), "i", "x")) == MAX_COMPONENTS
    with pytest.raises(StateFrameError, match=f"names {MAX_COMPONENTS + 1} lists; at most"):
        unpack_lists(packed_lists(*lists, [1]), "i", "x")
    with pytest.raises(StateFrameError, match="x is truncated"):
        unpack_lists(struct.pack("<II", 2, 0), "i", "x")
    with pytest.raises(StateFrameError, match="add up to 8 bytes, it carries 12"):
        unpack_lists(struct.pack("<II3i", 1, 8, 1, 2, 3), "i", "x")
    assert unpack_lists(struct.pack("<II2i", 1, 8, -1, 2), "i", "x") == ((-1, 2),)
    assert unpack_lists(struct.pack("<II2I", 1, 8, 2**32 - 1, 2), "I", "x") == ((2**32 - 1, 2),)


@given(st.binary(max_size=64))
def test_any_bytes_parse_or_are_refused(raw: bytes) -> None:
    try:
        lists = unpack_lists(raw, "i", "state_indices")
    except StateFrameError:
        return
    assert len(lists) <= MAX_COMPONENTS
