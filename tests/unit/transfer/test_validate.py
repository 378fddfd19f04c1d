"""Every bootstrap `register` is judged before any work (issue #12): sizes, addresses, device and
layout that used to raise on the engine thread are refusals with a reason and the numbers."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from prefill_worker.kv.layout import MLA, KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.latent import mla_mismatch
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    RejectReason,
    check_register,
    check_want_size,
)

OURS = KVLayout(2, 2, 8, "bfloat16", 4, 24)
FRAME = wire.frame_metadata(b"nixl metadata")


def register(**changes: object) -> wire.Register:
    """A valid register (decode pool of 100 pages at 1 MiB-aligned addresses), changed."""
    layout = dataclasses.replace(OURS, num_pages=int(changes.pop("num_pages", 100)))  # type: ignore[call-overload]
    regions = KVRegions(
        layout,
        tuple(changes.pop("k", (1 << 20, 2 << 20))),  # type: ignore[arg-type]
        (3 << 20, 4 << 20),
        str(changes.pop("device", "cpu")),
        int(changes.pop("aux", 5 << 20)),  # type: ignore[call-overload]
        int(changes.pop("aux_rows", 8)),  # type: ignore[call-overload]
    )
    msg = wire.Register.of("decode-1", FRAME, regions, layout.compat_hash())
    return msgspec.structs.replace(msg, **changes)


def test_a_valid_register_passes() -> None:
    assert check_register(register(), OURS, BootstrapLimits()) is None
    assert check_register(register(device="cuda:3"), OURS, BootstrapLimits()) is None


@pytest.mark.parametrize(
    ("changes", "reason", "words"),
    [
        ({"num_pages": 2**40}, RejectReason.TOO_LARGE, "1099511627776 pages"),
        ({"num_pages": 2**22}, RejectReason.TOO_LARGE, "at most 1048576"),
        ({"aux_rows": 2**21}, RejectReason.TOO_LARGE, "2097152 aux rows"),
        ({"k": (-4096, 2 << 20)}, RejectReason.BAD_ADDRESS, "region 0 [-4096"),
        ({"k": (0, 2 << 20)}, RejectReason.BAD_ADDRESS, "region 0"),
        ({"k": (1 << 20, 2**64 - 100)}, RejectReason.BAD_ADDRESS, "region 1"),
        ({"aux": 2**64 - 1}, RejectReason.BAD_ADDRESS, "region 4"),
        ({"device": "cuda:x"}, RejectReason.BAD_DEVICE, "'cuda:x'"),
        ({"device": "cuda:"}, RejectReason.BAD_DEVICE, "cpu or cuda:N"),
        ({"device": "tpu:0"}, RejectReason.BAD_DEVICE, "'tpu:0'"),
        ({"agent_name": ""}, RejectReason.BAD_NAME, "1..255 bytes"),
        ({"agent_name": "x" * 256}, RejectReason.BAD_NAME, "1..255 bytes"),
        ({"compat_hash": "0" * 16}, RejectReason.LAYOUT_MISMATCH, "KV layout mismatch"),
        ({"metadata": FRAME[:-1]}, RejectReason.BAD_METADATA, "length mismatch"),
        ({"metadata": b"PWMD"}, RejectReason.BAD_METADATA, "truncated: 4 bytes"),
    ],
)
def test_a_bad_register_is_refused_with_its_numbers(
    changes: dict[str, object], reason: RejectReason, words: str
) -> None:
    refusal = check_register(register(**changes), OURS, BootstrapLimits())
    assert refusal is not None and refusal.reason is reason
    assert words in refusal.message


def test_a_layout_that_differs_only_in_page_size_is_a_mismatch() -> None:
    msg = register()
    theirs = dataclasses.replace(msg.regions.layout, page_size=8)
    regions = dataclasses.replace(msg.regions, layout=theirs)
    msg = wire.Register.of(msg.agent_name, msg.metadata, regions, theirs.compat_hash())
    refusal = check_register(msg, OURS, BootstrapLimits())
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH


def test_descriptor_indices_must_fit_int32() -> None:
    limits = BootstrapLimits(max_peer_pages=2**31)
    refusal = check_register(register(num_pages=2**29), OURS, limits)
    assert refusal is not None and refusal.reason is RejectReason.TOO_LARGE
    assert "int32" in refusal.message


def test_max_peer_pages_is_the_operators_bound() -> None:
    assert check_register(register(num_pages=64), OURS, BootstrapLimits(max_peer_pages=64)) is None
    refusal = check_register(register(num_pages=65), OURS, BootstrapLimits(max_peer_pages=64))
    assert refusal is not None and "65 pages" in refusal.message


def test_a_want_is_sized_before_its_pages_are_read() -> None:
    peer = dataclasses.replace(OURS, num_pages=1000)
    fits = wire.Want.of(1, range(24), 0, 0)
    assert check_want_size(fits, OURS, peer) is None
    huge = wire.Want(1, b"\xff" * (4 * 2**20), 0, 0)  # 1 Mi page ids, none valid
    refusal = check_want_size(huge, OURS, peer)
    assert refusal is not None and refusal.reason is RejectReason.BAD_WANT
    assert refusal.message == "want names 1048576 pages; at most 24 can be needed"


def test_want_page_ids_stay_packed() -> None:
    want = wire.decode(wire.encode(wire.Want.of(7, [5, 0, 99], 3, 32)))
    assert isinstance(want, wire.Want)
    assert want.num_dst_pages == 3 and want.dst_page_ids.tolist() == [5, 0, 99]
    assert want.dst_page_ids.dtype.itemsize == 4 and not want.dst_page_ids.flags.writeable


def test_an_mha_decode_at_an_mla_worker_is_refused_naming_both_pools() -> None:
    mla = KVLayout(2, 1, 8, "bfloat16", 4, 24, kind=MLA)
    msg = register()
    refusal = check_register(msg, mla, BootstrapLimits())
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    assert refusal.message == mla_mismatch(msg.regions.layout, mla)


def test_a_register_carries_the_decode_rank_it_names() -> None:
    rank = wire.DecodeRank(1, 2, 1, 2)
    msg = register()
    named = wire.Register.of(msg.agent_name, msg.metadata, msg.regions, msg.compat_hash, rank)
    assert named.tp == rank
    assert wire.decode(wire.encode(named)) == named
