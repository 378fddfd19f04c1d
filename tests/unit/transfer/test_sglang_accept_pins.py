"""Pins for what the worker takes from SGLang decodes: behaviours that mutation testing
(`make mutation`, scripts/mutation.py) found no test held. Each refusal's full text is what an
operator reads in the log and the decode's KV_STATUS, so it is pinned word for word."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import json
from pathlib import Path

import pytest

from prefill_worker.kv.layout import MLA, PAGE_MAJOR, KVLayout
from prefill_worker.transfer.sglang.accept import (
    AUX_ROWS_BOUND,
    check_registration,
    check_request,
    check_source,
    peer_regions,
    rank_layout,
    server_info,
)
from prefill_worker.transfer.sglang.frames import Endpoint, Registration, TransferRequest, parse
from prefill_worker.transfer.validate import BootstrapLimits, Refusal, RejectReason

CAPTURED = json.loads((Path(__file__).parent / "sglang_frames.json").read_text())
OURS = KVLayout(2, 2, 16, "float32", 4, 64)  # what the captured decode was built for
LIMITS = BootstrapLimits()
PAGE = 512  # the captured decode's KV page bytes per region: 4 x 2 x 16 x 4


def captured(kind: str) -> list[bytes]:
    return [base64.b64decode(f) for f in CAPTURED["0.5.23"][kind]]


def registration(**changes: object) -> Registration:
    reg = parse(captured("registration"))
    assert isinstance(reg, Registration)
    return dataclasses.replace(reg, **changes)  # type: ignore[arg-type]


def request(**changes: object) -> TransferRequest:
    req = parse(captured("request"))
    assert isinstance(req, TransferRequest)
    return dataclasses.replace(req, **changes)  # type: ignore[arg-type]


def refused(reg: Registration) -> Refusal:
    refusal = check_registration(reg, OURS, LIMITS)
    assert refusal is not None
    return refusal


@pytest.mark.parametrize(
    ("changes", "reason", "message"),
    [
        (
            {"tp_size": 3},
            RejectReason.UNSUPPORTED,
            "decode attention TP size 3: 2 KV heads cannot be replicated over 3 ranks",
        ),
        (
            {"tp_size": 2, "tp_rank": 2},
            RejectReason.UNSUPPORTED,
            "decode attention TP rank 2 of 2",
        ),
        (
            {"kv_ptrs": (1, 2)},
            RejectReason.LAYOUT_MISMATCH,
            "decode registered 2 KV regions; this worker's model has 2 layers (4 regions: K "
            "and V of each)",
        ),
        (
            {"has_state": True},
            RejectReason.UNSUPPORTED,
            "the decode registered state buffers (a hybrid model)",
        ),
        (
            {"has_staging": True},
            RejectReason.UNSUPPORTED,
            "the decode registered a staging buffer (heterogeneous TP)",
        ),
        (
            {"kv_layer_ids": (1, 0, 1, 0)},
            RejectReason.UNSUPPORTED,
            "the decode's KV regions are not one K and one V per layer",
        ),
        (
            {"kv_item_lens": (PAGE,)},  # one length for four regions
            RejectReason.LAYOUT_MISMATCH,
            f"decode KV page is [{PAGE}] bytes per region; this worker's is {PAGE} (page_size 4 "
            "x 2 KV heads x head_dim 16 x 4 bytes of float32): the page size, KV dtype or head "
            "layout differ",
        ),
        (
            {"mem_kinds": ("A", "B", "C", "D", "E")},
            RejectReason.BAD_DEVICE,
            "KV memory kinds ['A', 'B', 'C', 'D']: one of DRAM or VRAM for every region",
        ),
        (
            {"mem_kinds": ("DRAM",) * 3},
            RejectReason.BAD_DEVICE,
            "one KV memory kind per region is needed",
        ),
        (
            {"aux_ptrs": (1,) * 9},
            RejectReason.UNSUPPORTED,
            "decode registered 9 metadata buffers; this worker fills SGLang's default 10 "
            "(output_ids, cached_tokens, output_token_logprobs_val, "
            "output_token_logprobs_idx, output_top_logprobs_val, output_top_logprobs_idx, "
            "output_topk_p, output_topk_index, output_hidden_states, bootstrap_room): turn off "
            "SGLANG_ENABLE_DISAGG_SAMPLING_MASK and --disaggregation-enable-kv-checksum "
            "(nor a DSA model's MTP seed row: index_share_for_mtp_iteration)",
        ),
        (
            {"aux_ptrs": (1,) * 9 + (2**64,)},
            RejectReason.BAD_ADDRESS,
            "a metadata buffer address is 0",
        ),
    ],
)
def test_each_refusal_says_exactly_why(changes: dict, reason: RejectReason, message: str) -> None:
    refusal = refused(registration(**changes))
    assert (refusal.reason, refusal.message) == (reason, message)


def test_the_bounds_of_an_accepted_registration_are_inclusive() -> None:
    accepted = [
        registration(kv_layer_ids=(0, 1, 0, 1)),  # the natural ids, sent explicitly
        registration(kv_item_lens=()),  # older decodes send no per-region lengths
        registration(num_slots=1),
        registration(num_slots=LIMITS.max_peer_pages, kv_ptrs=(1 << 40,) * 4),
        registration(kv_ptrs=(1, 2, 3, 2**64 - 17 * PAGE)),  # the last region ends at 2**64
        registration(aux_ptrs=(1,) * 9 + (2**64 - 1,)),
    ]
    for reg in accepted:
        assert check_registration(reg, OURS, LIMITS) is None, reg
    assert refused(registration(num_slots=LIMITS.max_peer_pages + 1)).reason is (
        RejectReason.TOO_LARGE
    )
    assert refused(registration(num_slots=0)).reason is RejectReason.TOO_LARGE


def test_a_pool_without_memory_kinds_is_on_the_gpu_and_its_aux_rows_are_int32() -> None:
    reg = registration(mem_kinds=(), gpu_id=2)
    assert check_registration(reg, OURS, LIMITS) is None
    regions = peer_regions(reg, OURS)
    assert regions.device == "cuda:2"
    assert regions.num_aux_rows == AUX_ROWS_BOUND == 2**31 - 1


def test_a_refused_request_says_exactly_why() -> None:
    tail = "; from this worker (attention TP 1) a decode of attention TP 1 needs 1"
    wide = check_request(request(), 2, 1)  # a rank of attention TP 2 names both ranks
    assert wide is not None and wide.message == (
        "the room needs 1 decode ranks; from this worker (attention TP 1) a decode of "
        "attention TP 2 needs 2"
    )
    cases = {
        "ranks": (request(required_dst_info_num=2), "the room needs 2 decode ranks" + tail),
        "dummy": (
            request(is_dummy=True),
            "a dummy request (no pages) from a decode of attention TP 1 to this worker "
            "(attention TP 1, K/V): SGLang sends dummies only for an MLA model, from a decode "
            "of the smaller TP",
        ),
        "state": (
            request(has_state=True),
            "the request names state slots (a hybrid model); this worker sends KV only",
        ),
    }
    for what, (req, message) in cases.items():
        refusal = check_request(req)
        assert refusal is not None, what
        assert (refusal.reason, refusal.message) == (RejectReason.UNSUPPORTED, message), what


def test_route_answers_one_rank_of_everything() -> None:
    assert server_info(16, "fp8_e4m3") == {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "fp8_e4m3",
        "follow_bootstrap_room": True,
    }


def test_a_frame_must_come_from_the_address_it_names() -> None:
    assert check_source(Endpoint("127.0.0.1", 9), "127.0.0.1") is None
    assert check_source(Endpoint("::1", 9), "[::1]") is None  # a bracketed IPv6 source
    assert check_source(Endpoint("10.0.0.7", 9), "::ffff:10.0.0.7") is None  # IPv4-mapped
    for claimed, source in [("10.0.0.7", "10.0.0.8"), ("::1", "::2"), ("::1", "not-an-ip")]:
        refusal = check_source(Endpoint(claimed, 9), source)
        assert refusal is not None
        assert (refusal.reason, refusal.message) == (
            RejectReason.SPOOFED_ADDRESS,
            f"the frame names {claimed} but came from {source}",
        )


def test_a_frame_from_outside_the_allowed_networks_is_refused() -> None:
    allowed = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")]
    assert check_source(Endpoint("10.1.2.3", 9), "10.1.2.3", allowed) is None
    assert check_source(Endpoint("fd00::5", 9), "fd00::5", allowed) is None
    refusal = check_source(Endpoint("192.168.0.1", 9), "192.168.0.1", allowed)
    assert refusal is not None
    assert (refusal.reason, refusal.message) == (
        RejectReason.NETWORK_NOT_ALLOWED,
        "192.168.0.1 is outside transfer.sglang_allowed_networks",
    )


def test_a_decode_ranks_heads_are_checked_against_its_own_tp_alone() -> None:
    """A rank's pool is ours with its heads (every other field ours); its TP size is
    checked against our heads alone (3 heads split over 3 ranks, not over 2); an MLA decode
    of attention TP 2 holds the whole latent on each rank: accepted from a worker of TP 1 or
    2, refused, word for word, from a worker of TP 4."""
    half = registration(tp_size=2, tp_rank=1, kv_item_len=PAGE // 2)
    paged = dataclasses.replace(OURS, kind=PAGE_MAJOR)
    assert rank_layout(half, paged) == dataclasses.replace(paged, num_kv_heads=1)
    three = KVLayout(2, 3, 16, "float32", 4, 64)
    third = registration(tp_size=3, tp_rank=2, kv_item_len=256, kv_item_lens=(256,) * 4)
    assert check_registration(third, three, LIMITS) is None
    mla = KVLayout(2, 1, 32, "float32", 4, 64, MLA)
    latent = {"kv_ptrs": (1, 2), "mem_kinds": ("DRAM",) * 2, "kv_item_lens": ()}
    for rank in (0, 1):
        reg = registration(tp_size=2, tp_rank=rank, kv_item_len=512, **latent)
        assert rank_layout(reg, mla) == mla
        assert check_registration(reg, mla, LIMITS) is None
        assert check_registration(reg, mla, LIMITS, prefill_tp_size=1) is None
        assert check_registration(reg, mla, LIMITS, prefill_tp_size=2) is None
    refusal = check_registration(reg, mla, LIMITS, prefill_tp_size=4)
    assert refusal is not None and (refusal.reason, refusal.message) == (
        RejectReason.UNSUPPORTED,
        "an MLA decode of attention TP 2 at this worker of TP 4: an MLA decode of attention "
        "TP > 1 is served by a worker of no larger TP; run it at attention TP 1, or against "
        "a worker of TP 2 or less",
    )
    half = registration(tp_size=2, tp_rank=1, kv_item_len=256, **latent)
    refusal = check_registration(half, mla, LIMITS)
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    whole = registration(kv_item_len=512, **latent)
    assert check_registration(whole, mla, LIMITS, prefill_tp_size=4) is None
