"""What the worker takes from SGLang decodes: a registration whose pool can take this worker's
pages byte for byte is a peer (its regions as SGLang laid them out); anything else is refused
with the mismatch named. And the metadata row it writes is SGLang's."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from prefill_worker.kv.aux import AuxRow
from prefill_worker.kv.layout import KVLayout
from prefill_worker.transfer.headplan import HeadSlice
from prefill_worker.transfer.sglang import aux
from prefill_worker.transfer.sglang.accept import (
    check_registration,
    check_request,
    is_dummy_expected,
    peer_regions,
    rank_slice,
    server_info,
    status_ranks,
    target_ranks,
)
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest, parse
from prefill_worker.transfer.validate import BootstrapLimits, RejectReason

CAPTURED = json.loads((Path(__file__).parent / "sglang_frames.json").read_text())
OURS = KVLayout(2, 2, 16, "float32", 4, 64)  # what the captured decode was built for
LIMITS = BootstrapLimits()


def registration(**changes: object) -> Registration:
    frames = [base64.b64decode(f) for f in CAPTURED["0.5.23"]["registration"]]
    reg = parse(frames)
    assert isinstance(reg, Registration)
    return dataclasses.replace(reg, **changes)  # type: ignore[arg-type]


def test_the_captured_decode_is_accepted_as_sglang_laid_it_out() -> None:
    reg = registration()
    assert check_registration(reg, OURS, LIMITS) is None
    regions = peer_regions(reg, OURS)
    assert regions.k_base_addrs == reg.kv_ptrs[:2] and regions.v_base_addrs == reg.kv_ptrs[2:]
    assert regions.layout.num_pages == 17 and regions.layout.page_bytes == reg.kv_item_len
    assert regions.device == "cpu" and regions.aux_base_addr == reg.aux_ptrs[0]
    assert peer_regions(registration(mem_kinds=("VRAM",) * 4, gpu_id=3), OURS).device == "cuda:3"


@pytest.mark.parametrize(
    ("changes", "reason", "words"),
    [
        ({"tp_size": 3}, RejectReason.UNSUPPORTED, "attention TP size 3"),
        ({"dcp_size": 2}, RejectReason.UNSUPPORTED, "DCP"),
        ({"has_state": True}, RejectReason.UNSUPPORTED, "state buffers"),
        ({"has_staging": True}, RejectReason.UNSUPPORTED, "staging"),
        ({"kv_layer_ids": (5, 6, 5, 6)}, RejectReason.UNSUPPORTED, "one K and one V"),
        ({"kv_ptrs": (1, 2)}, RejectReason.LAYOUT_MISMATCH, "2 KV regions"),
        ({"kv_item_len": 64, "kv_item_lens": (64,) * 4}, RejectReason.LAYOUT_MISMATCH, "page"),
        ({"kv_item_lens": (512, 512, 512, 256)}, RejectReason.LAYOUT_MISMATCH, "256"),
        ({"mem_kinds": ("DRAM", "VRAM", "DRAM", "DRAM")}, RejectReason.BAD_DEVICE, "kinds"),
        ({"mem_kinds": ("HBM",) * 4}, RejectReason.BAD_DEVICE, "DRAM or VRAM"),
        ({"num_slots": 2**21}, RejectReason.TOO_LARGE, "max_peer_pages"),
        ({"kv_ptrs": (0, 1, 2, 3)}, RejectReason.BAD_ADDRESS, "KV region 0 [0, 0 + "),
        ({"kv_ptrs": (2**64 - 10, 1, 2, 3)}, RejectReason.BAD_ADDRESS, "address space"),
        ({"aux_ptrs": (1,) * 13}, RejectReason.UNSUPPORTED, "13 metadata buffers"),
        ({"aux_ptrs": (0,) * 10}, RejectReason.BAD_ADDRESS, "metadata buffer"),
        ({"agent_name": "someone-else"}, RejectReason.BAD_METADATA, "does not name"),
    ],
)
def test_what_is_refused_is_named(changes: dict, reason: RejectReason, words: str) -> None:
    refusal = check_registration(registration(**changes), OURS, LIMITS)
    assert refusal is not None and refusal.reason is reason
    assert words in refusal.message


def test_the_page_mismatch_names_the_numbers() -> None:
    theirs = dataclasses.replace(OURS, page_size=16)
    refusal = check_registration(registration(), theirs, LIMITS)
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    assert "[512] bytes" in refusal.message and "2048 (page_size 16" in refusal.message


def test_requests_for_more_than_one_decode_rank_are_refused() -> None:
    frames = [base64.b64decode(f) for f in CAPTURED["0.5.23"]["request"]]
    req = parse(frames)
    assert isinstance(req, TransferRequest) and check_request(req) is None
    for changes in ({"required_dst_info_num": 2}, {"is_dummy": True}, {"has_state": True}):
        refusal = check_request(dataclasses.replace(req, **changes))  # type: ignore[arg-type]
        assert refusal is not None and refusal.reason is RejectReason.UNSUPPORTED


def test_route_answers_only_what_every_supported_decode_accepts() -> None:
    # PrefillServerInfo(**json) in 0.5.20-0.5.23: these seven are its required fields; an
    # extra key (0.5.23's enable_kv_cache_sharding, say) is fatal on an older decode.
    info = server_info(16, "auto")
    assert set(info) == {
        "attn_tp_size",
        "attn_cp_size",
        "dp_size",
        "pp_size",
        "page_size",
        "kv_cache_dtype",
        "follow_bootstrap_room",
    }
    assert (info["page_size"], info["kv_cache_dtype"], info["follow_bootstrap_room"]) == (
        16,
        "auto",
        True,
    )


def test_the_metadata_row_is_sglangs() -> None:
    # SGLang's MetadataBuffers defaults: item sizes in its buffer order, bootstrap_room last.
    assert aux.ITEM_BYTES == (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)
    assert aux.AUX_BUFFER_NAMES[0] == "output_ids" and aux.AUX_BUFFER_NAMES[-1] == "bootstrap_room"
    staging = aux.AuxStaging(4)
    staging.fill(2, AuxRow(77, -1.5, 30, 16, num_computed_tokens=12), room=2**62 + 5)
    row = staging.rows[2]
    assert row["output_ids"][0] == 77 and not row["output_ids"][1:].any()
    assert row["cached_tokens"][0] == 18  # not computed here: from the prefix cache
    assert row["output_token_logprobs_val"][0] == np.float32(-1.5)
    assert row["output_token_logprobs_idx"][0] == 77
    assert int(row["bootstrap_room"][0]) == 2**62 + 5
    assert not row["output_top_logprobs_val"].any() and not row["output_hidden_states"].any()
    staging.fill(2, AuxRow(9, math.nan, 30, 0), room=1)  # no logprob asked: zeros, all stale gone
    assert staging.rows[2]["cached_tokens"][0] == 0  # no count reported
    assert staging.rows[2]["output_token_logprobs_val"][0] == 0
    assert staging.rows[2]["output_token_logprobs_idx"][0] == 0
    local = staging.local_descs(2)
    assert local[0, 0] == staging.base_addr + 2 * 1600 and local[:, 1].sum() == 1600
    assert np.array_equal(np.diff(local[:, 0].astype(np.int64)), np.array(aux.ITEM_BYTES[:-1]))
    remote = aux.remote_descs(tuple(range(1000, 11000, 1000)), slot=3)
    assert list(remote[:, 0]) == [1000 * (i + 1) + 3 * n for i, n in enumerate(aux.ITEM_BYTES)]


def test_the_aux_view_reads_the_engines_rows() -> None:
    from prefill_worker.kv.aux import AuxPool

    pool = AuxPool(3)
    row = pool.try_alloc()
    assert row is not None
    pool.write(row, AuxRow(5, -0.5, 10, 4))
    assert aux.AuxRowsView(pool.base_addr, 3).read(row) == AuxRow(5, -0.5, 10, 4)


def test_a_decode_rank_of_attention_tp_2_is_accepted_with_its_heads() -> None:
    half = OURS.page_bytes // 2  # one of the two KV heads per token
    reg = registration(tp_size=2, tp_rank=1, kv_item_len=half, kv_item_lens=(half,) * 4)
    assert check_registration(reg, OURS, LIMITS) is None
    assert peer_regions(reg, OURS).layout.num_kv_heads == 1
    assert rank_slice(reg, OURS) == HeadSlice(0, 1, 1, 0, 1, 2, 1)  # our head 1, its head 0
    whole = registration(tp_size=2, tp_rank=1)  # a pool of every head: not a TP-2 rank
    refusal = check_registration(whole, OURS, LIMITS)
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    frames = [base64.b64decode(f) for f in CAPTURED["0.5.23"]["request"]]
    req = dataclasses.replace(parse(frames), required_dst_info_num=2)  # type: ignore[type-var]
    assert check_request(req, decode_tp_size=2) is None  # type: ignore[arg-type]
    assert check_request(req) is not None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("decode", "worker", "is_mla", "asked", "answering", "dummies"),
    [
        # (decode rank, d), p: SGLang's _resolve_rank_mapping in 0.5.20-0.5.23
        ((0, 1), 2, True, range(2), range(1), True),  # real to 0, a dummy to 1
        ((1, 2), 4, True, range(2, 4), range(2, 3), True),
        ((0, 1), 2, False, range(2), range(2), False),  # K/V: both real, two statuses
        ((1, 2), 2, True, range(1, 2), range(1, 2), False),
        ((3, 4), 2, True, range(1, 2), range(1, 2), False),  # d > p: one rank, no dummy
        ((0, 1), 1, True, range(1), range(1), False),
    ],
)
def test_which_worker_ranks_a_decode_rank_asks_and_hears_from(
    decode: tuple[int, int],
    worker: int,
    is_mla: bool,
    asked: range,
    answering: range,
    dummies: bool,
) -> None:
    """Its requests go to ``asked`` (an ABORT_ACK from each); a KV_STATUS comes from
    ``answering``: an MLA decode's first rank only, the others are sent dummies."""
    assert target_ranks(*decode, worker) == asked
    assert status_ranks(*decode, worker, is_mla) == answering
    assert is_dummy_expected(decode[1], worker, is_mla) is dummies
