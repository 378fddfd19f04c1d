"""The bootstrap `register` limits at their exact boundaries: the last value that passes and
the first that is refused (found unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    RejectReason,
    check_register,
    duplicate_want,
    foreign_room,
)
from tests.unit.transfer.test_validate import OURS, register


def refused(msg: wire.Register, limits: BootstrapLimits | None = None) -> RejectReason | None:
    refusal = check_register(msg, OURS, limits or BootstrapLimits())
    return None if refusal is None else refusal.reason


def test_an_agent_name_of_exactly_255_bytes_passes_and_256_is_refused() -> None:
    assert refused(register(agent_name="é" * 127 + "x")) is None  # 255 bytes, 128 characters
    assert refused(register(agent_name="é" * 128)) is RejectReason.BAD_NAME  # 256 bytes


def test_aux_rows_of_exactly_max_peer_pages_pass() -> None:
    limits = BootstrapLimits(max_peer_pages=64)
    assert refused(register(num_pages=64, aux_rows=64), limits) is None
    assert refused(register(num_pages=64, aux_rows=65), limits) is RejectReason.TOO_LARGE


def test_exactly_the_int32_index_space_of_descriptors_passes() -> None:
    limits = BootstrapLimits(max_peer_pages=2**30)
    num_regions = OURS.num_regions
    pages = (2**31 - 1) // num_regions
    rows = 2**31 - 1 - num_regions * pages
    assert refused(register(num_pages=pages, aux_rows=rows), limits) is None
    assert refused(register(num_pages=pages, aux_rows=rows + 1), limits) is RejectReason.TOO_LARGE


def test_address_1_and_a_region_ending_at_2_to_the_64_pass() -> None:
    assert refused(register(k=(1, 2 << 20))) is None
    msg = register()
    region_bytes = msg.regions.layout.region_bytes
    assert refused(register(k=(1 << 20, 2**64 - region_bytes))) is None
    assert refused(register(k=(1 << 20, 2**64 - region_bytes + 1))) is RejectReason.BAD_ADDRESS


@pytest.mark.parametrize(
    "changes",
    [{"page_size": 8}, {"dtype": "float16"}, {"num_kv_heads": 1}, {"head_dim": 16}],
)
def test_a_different_layout_is_refused_even_under_our_compat_hash(
    changes: dict[str, object],
) -> None:
    """A peer may send our hash with its own layout: the fields are compared too."""
    msg = register()
    theirs = dataclasses.replace(msg.regions.layout, **changes)
    regions = dataclasses.replace(msg.regions, layout=theirs)
    lying = wire.Register.of(msg.agent_name, msg.metadata, regions, OURS.compat_hash())
    assert refused(lying) is RejectReason.LAYOUT_MISMATCH


def test_a_long_device_name_is_quoted_to_40_characters() -> None:
    refusal = check_register(register(device="x" * 60), OURS, BootstrapLimits())
    assert refusal is not None and refusal.reason is RejectReason.BAD_DEVICE
    assert refusal.message == f"device {'x' * 40!r} is not cpu or cuda:N"


def test_room_refusals_name_their_room() -> None:
    duplicate, foreign = duplicate_want(7), foreign_room(9)
    assert duplicate.reason is RejectReason.DUPLICATE_WANT
    assert duplicate.message == "duplicate want for 7"
    assert foreign.reason is RejectReason.FOREIGN_ROOM
    assert foreign.message == "room 9 is reserved by the router for another decode peer"


def test_a_metadata_frame_with_a_bad_header_or_checksum_is_refused_saying_which() -> None:
    good = register().metadata
    bad_magic = b"X" + good[1:]
    bad_pad = good[:5] + b"\x01" + good[6:]
    corrupt = good[:-1] + bytes([good[-1] ^ 1])
    for frame, message in [
        (bad_magic, "metadata frame has a bad magic or version"),
        (bad_pad, "metadata frame has a bad magic or version"),
        (corrupt, "metadata frame checksum mismatch"),
    ]:
        refusal = check_register(register(metadata=frame), OURS, BootstrapLimits())
        assert refusal is not None and refusal.reason is RejectReason.BAD_METADATA
        assert refusal.message == message
