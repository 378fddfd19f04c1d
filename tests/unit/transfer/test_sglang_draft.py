"""A draft beside the target on SGLang's wire (``transfer.draft``): which speculating decodes
a worker accepts and how their pool is addressed (``accept``), the draft's rows
(``kv.draft_rows``) and the pool of target and draft layers. The bytes landing in SGLang's
own decode: tests/interop/test_draft_landing.py."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_worker.batch import DraftRow
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import PAGE_MAJOR, KVRegions
from prefill_worker.transfer.draft import with_draft_layers
from prefill_worker.transfer.sglang.accept import (
    check_registration,
    num_draft_entries,
    peer_regions,
)
from prefill_worker.transfer.validate import RejectReason
from tests.unit.transfer.test_mla import OURS as MLA_OURS
from tests.unit.transfer.test_mla import mla_registration
from tests.unit.transfer.test_sglang_accept import LIMITS, OURS, registration
from tests.unit.transfer.test_sglang_desk import Rig as DeskRig
from tests.unit.transfer.test_sglang_desk import registration as desk_registration

PAGE = 512  # the captured decode's page bytes


def speculating(extra: int, page: int = PAGE) -> dict[str, object]:
    """The captured MHA decode with ``extra`` draft regions after its 4 (K0 K1 V0 V1)."""
    reg = registration()
    ptrs = reg.kv_ptrs + tuple(reg.kv_ptrs[-1] + (i + 1) * 2**20 for i in range(extra))
    return {
        "kv_ptrs": ptrs,
        "kv_item_lens": (PAGE,) * 4 + (page,) * extra,
        "mem_kinds": ("DRAM",) * len(ptrs),
    }


def test_a_drafting_worker_addresses_the_decodes_draft_layer_after_the_targets() -> None:
    reg = registration(**speculating(2))  # its draft: K then V of one layer
    assert check_registration(reg, OURS, LIMITS, num_draft_layers=1) is None
    regions = peer_regions(reg, OURS, 1)
    assert regions.layout.num_layers == 3 and num_draft_entries(reg, OURS) == 2
    k0, k1, v0, v1, dk, dv = reg.kv_ptrs
    assert regions.k_base_addrs == (k0, k1, dk) and regions.v_base_addrs == (v0, v1, dv)
    mla = mla_registration(
        kv_ptrs=(8 << 20, 9 << 20, 10 << 20), kv_item_lens=(512,) * 3, mem_kinds=("DRAM",) * 3
    )
    assert check_registration(mla, MLA_OURS, LIMITS, num_draft_layers=1) is None
    latent = peer_regions(mla, MLA_OURS, 1)
    assert latent.k_base_addrs == mla.kv_ptrs and latent.v_base_addrs == ()


def test_a_worker_without_a_draft_addresses_only_the_target() -> None:
    reg = registration(**speculating(2, page=256))  # another draft's pages: never written
    assert check_registration(reg, OURS, LIMITS) is None
    regions = peer_regions(reg, OURS)
    assert regions.layout.num_layers == 2 and regions.v_base_addrs == reg.kv_ptrs[2:4]
    assert num_draft_entries(registration(), OURS) == 0


@pytest.mark.parametrize(
    ("extra", "num_draft_layers", "page", "words"),
    [
        (4, 1, PAGE, "decode registered 8 KV regions; this worker's model has 2 layers and a "
                     "draft of 1 layers (4 regions"),
        (1, 0, PAGE, "decode registered 5 KV regions"),  # half a layer
        (4, 0, PAGE, "decode registered 8 KV regions"),  # as many as the target: not a draft
        (2, 1, 256, "decode KV page is [256, 512] bytes"),  # the draft's pages are not ours
    ],
)  # fmt: skip
def test_a_draft_pool_this_worker_cannot_fill_is_refused(
    extra: int, num_draft_layers: int, page: int, words: str
) -> None:
    reg = registration(**speculating(extra, page))
    refusal = check_registration(reg, OURS, LIMITS, num_draft_layers=num_draft_layers)
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    assert words in refusal.message, refusal.message


def test_draft_rows_keep_each_proposal_by_aux_row() -> None:
    rows = DraftRows(3, 8)
    assert rows.read(1) is None and rows.row_bytes == 4 + 64 + 128 + 8
    draft = DraftRow((0.75, 0.25), (9, 2**40), bytes(range(8)))
    rows.write(1, draft)
    assert rows.read(1) == draft and rows.read(0) is None and rows.read(2) is None
    for bad, why in [
        (DraftRow((), (), bytes(8)), "0 probabilities"),
        (DraftRow((0.5,) * 17, (1,) * 17, bytes(8)), "a row holds 1 to 16"),
        (DraftRow((0.5,), (1, 2), bytes(8)), "and 2 ids"),
        (DraftRow((0.5,), (1,), bytes(9)), "is 9 bytes; a row holds 8"),
    ]:
        with pytest.raises(ValueError, match=why):
            rows.write(2, bad)
    assert rows.read(2) is None


def test_the_draft_layers_follow_the_targets_in_one_pool() -> None:
    target = KVRegions(OURS, (100, 200), (300, 400), "cpu", 7, 4)
    draft_layout = dataclasses.replace(OURS, num_layers=1)
    draft = KVRegions(draft_layout, (500,), (600,), "cpu", 8, 4)
    both = with_draft_layers(target, draft)
    assert both.layout == dataclasses.replace(OURS, num_layers=3)
    assert both.k_base_addrs == (100, 200, 500) and both.v_base_addrs == (300, 400, 600)
    assert (both.aux_base_addr, both.num_aux_rows) == (7, 4)
    for other, why in [
        (
            dataclasses.replace(draft, layout=dataclasses.replace(draft_layout, head_dim=8)),
            "is not",
        ),
        (dataclasses.replace(draft, layout=dataclasses.replace(draft_layout, num_pages=5)), "x 5"),
        (dataclasses.replace(draft, device="cuda:0"), "is not the target's"),
    ]:
        with pytest.raises(ValueError, match=why):
            with_draft_layers(target, other)
    page_major = dataclasses.replace(OURS, kind=PAGE_MAJOR)
    paged = KVRegions(page_major, (0, 2 * PAGE), (PAGE, 3 * PAGE), "cpu", 7, 4)
    with pytest.raises(ValueError, match="layer-major or mla"):
        with_draft_layers(paged, draft)


@pytest.mark.parametrize(("num_draft_layers", "num_layers"), [(1, 3), (0, 2)])
def test_the_desk_keeps_a_speculating_decode_with_what_it_will_be_written(
    num_draft_layers: int, num_layers: int
) -> None:
    """Its draft regions counted (its metadata rows are the speculating layout), its pool
    the target's layers and, at a worker with a draft, the draft's; a repeat is the same."""
    rig = DeskRig(num_draft_layers=num_draft_layers)
    reg = dataclasses.replace(desk_registration(), **speculating(2))
    rig.send(reg)
    rig.send(reg)
    peer = rig.peers[reg.agent_name]
    assert peer.num_draft_entries == 2 and peer.regions.layout.num_layers == num_layers
    assert rig.rejects == []
    plain = desk_registration("plain-decode")
    rig.send(dataclasses.replace(plain, endpoint=dataclasses.replace(plain.endpoint, port=1)))
    assert rig.peers["plain-decode"].num_draft_entries == 0


def test_a_draft_of_two_layers_is_their_ks_then_their_vs() -> None:
    ours = dataclasses.replace(OURS, num_layers=4)
    ptrs = tuple((i + 1) << 20 for i in range(12))  # K0-3 V0-3, then the draft's K0 K1 V0 V1
    reg = registration(kv_ptrs=ptrs, kv_item_lens=(PAGE,) * 12, mem_kinds=("DRAM",) * 12)
    assert check_registration(reg, ours, LIMITS, num_draft_layers=2) is None
    regions = peer_regions(reg, ours, 2)
    assert regions.k_base_addrs == ptrs[:4] + ptrs[8:10]
    assert regions.v_base_addrs == ptrs[4:8] + ptrs[10:12]
    refusal = check_registration(reg, ours, LIMITS, num_draft_layers=1)
    assert refusal is not None and "and a draft of 1 layers" in refusal.message


def test_the_desk_of_a_drafting_worker_refuses_a_draft_pool_of_other_pages() -> None:
    rig = DeskRig(num_draft_layers=1)
    reg = dataclasses.replace(desk_registration(), **speculating(2, page=256))
    rig.send(reg)
    assert rig.peers == {} and rig.rejects == ["layout_mismatch"]
