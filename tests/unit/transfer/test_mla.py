"""An MLA pool (kind ``mla``) at the transfer's seams: its layout travels on the wire, a
mismatched decode is named with both shapes, and an SGLang MLA decode's registration (one
latent region per layer) is a peer. Which tensor-parallel rank writes it: test_headplan.py."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from prefill_worker.kv.layout import MLA, KVLayout
from prefill_worker.transfer import wire
from prefill_worker.transfer.latent import mla_mismatch
from prefill_worker.transfer.sglang.accept import check_registration, peer_regions
from prefill_worker.transfer.sglang.frames import Registration
from prefill_worker.transfer.validate import RejectReason
from tests.unit.transfer.test_sglang_accept import LIMITS, registration

# The captured SGLang decode's page is 512 bytes: so is a latent of 32 fp32 at page size 4.
OURS = KVLayout(2, 1, 32, "float32", 4, 64, MLA)
MHA = KVLayout(2, 2, 16, "float32", 4, 64)


def mla_registration(**changes: object) -> Registration:
    reg = registration()
    mla = {"kv_ptrs": reg.kv_ptrs[:2], "kv_item_lens": (512, 512), "mem_kinds": ("DRAM",) * 2}
    return registration(**(mla | changes))


def test_an_mla_layout_travels_as_kind_mla() -> None:
    described = wire.Described(
        agent_name="w",
        layout=wire.Layout.of(OURS),
        compat_hash=OURS.compat_hash(),
        peer_timeout_s=5.0,
        heartbeat_interval_s=1.0,
    )
    got = wire.decode(wire.encode(described))
    assert isinstance(got, wire.Described) and got.layout.to_kv() == OURS
    register = wire.Register("d", b"md", wire.Layout.of(OURS), (8, 16), (), "cpu", 64, 1, "h")
    assert wire.decode(wire.encode(register)) == register
    with_v = msgspec.msgpack.decode(wire.encode(register)) | {"v_base_addrs": [24, 32]}
    with pytest.raises(wire.WireError, match="an mla pool has one latent address per layer"):
        wire.decode(msgspec.msgpack.encode(with_v))


def test_a_mismatch_with_an_mla_pool_names_both_shapes() -> None:
    assert mla_mismatch(MHA, dataclasses.replace(MHA, head_dim=8)) is None  # not ours to say
    assert mla_mismatch(dataclasses.replace(OURS, num_pages=8), OURS) is None
    wider = dataclasses.replace(OURS, head_dim=48)
    assert mla_mismatch(wider, OURS) == (
        "KV layout mismatch: the decode pool is mla (one latent of 48 values per token and "
        "layer), this worker's is mla (one latent of 32 values per token and layer); size the "
        "decode pool from the worker's layout (describe, or kv_layout in /readyz)"
    )
    why = mla_mismatch(OURS, MHA)
    assert why is not None and "is mla (one latent of 32" in why
    assert "this worker's is layer_major (2 KV heads x head_dim 16)" in why


def test_an_sglang_mla_decode_is_a_peer_with_one_latent_region_per_layer() -> None:
    reg = mla_registration()
    assert check_registration(reg, OURS, LIMITS) is None
    regions = peer_regions(reg, OURS)
    assert regions.layout.kind == MLA and regions.v_base_addrs == ()
    assert regions.k_base_addrs == reg.kv_ptrs
    assert regions.layout.page_bytes == 512 and regions.layout.num_pages == 17
    named = mla_registration(kv_layer_ids=(0, 1))
    assert check_registration(named, OURS, LIMITS) is None
    for rank in (0, 1):  # a rank of attention TP 2 holds the whole latent, as TP 1 does
        ranked = mla_registration(tp_size=2, tp_rank=rank)
        assert check_registration(ranked, OURS, LIMITS) is None
        assert peer_regions(ranked, OURS) == regions


@pytest.mark.parametrize(
    ("changes", "reason", "words"),
    [
        (
            {"tp_size": 2, "prefill_tp_size": 4},
            RejectReason.UNSUPPORTED,
            "an MLA decode of attention TP 2 at this worker of TP 4",
        ),
        ({"kv_layer_ids": (0, 0)}, RejectReason.UNSUPPORTED, "not one latent per layer"),
        (
            {"kv_item_lens": (256, 256)},
            RejectReason.LAYOUT_MISMATCH,
            "(page_size 4 x latent 32 x 4 bytes of float32): the page size, KV dtype or "
            "latent width differ",
        ),
    ],
)
def test_what_an_mla_worker_refuses_is_named(
    changes: dict, reason: RejectReason, words: str
) -> None:
    reg_changes = {k: v for k, v in changes.items() if k != "prefill_tp_size"}
    prefill_tp_size = changes.get("prefill_tp_size", 1)
    refusal = check_registration(mla_registration(**reg_changes), OURS, LIMITS, prefill_tp_size)
    assert refusal is not None and refusal.reason is reason
    assert words in refusal.message


def test_an_mha_decode_at_an_mla_worker_is_refused_by_its_regions() -> None:
    refusal = check_registration(registration(), OURS, LIMITS)
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    assert refusal.message == (
        "decode registered 4 KV regions; this worker's model has 2 layers (2 regions: the MLA "
        "latent of each)"
    )
