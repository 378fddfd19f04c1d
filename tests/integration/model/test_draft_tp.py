"""Drafts at TP 2 (``draft_tp_ranks``: two real gloo processes), against the references written
from the drafts' definitions (``test_eagle_draft``, ``test_mtp_draft``), which are what TP 1
gives within the same 1e-4 (those tests).

EAGLE-3 on the tiny 4-layer Llama (4 query heads, 2 K/V heads): each rank runs 2 query heads
and keeps 1 K/V head of the draft layer, its MLP half the width, the o and down projections
summed over the ranks; the two ranks' draft pools, joined by the head rule, equal the
reference's K and V. DeepSeek-V3's MTP layer: query heads and experts split, the latent
replicated, so both ranks' draft pools hold the reference's rows. Either way every rank
proposes the same top-k and hidden state (the residual stream is whole on every rank), equal
to the reference; only the leader's proposals are kept (``DraftingRunner.draft_rows`` is
attached on the leader alone: ``service.startup.attach_draft``), so each request's row is
written once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.model.parallel import gather_kv_heads
from tests.checkpoints import hf_model, prompt, with_mtp_layer
from tests.eagle_checkpoints import KV_HEADS, target_and_draft
from tests.integration.model import test_eagle_draft, test_mtp_draft
from tests.integration.model.draft_tp_ranks import SIZE, TOPK, result_path, run_ranks

TOL = 1e-4
PROMPTS = {"a": prompt(50, seed=31), "b": prompt(75, seed=32)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the ranks' results, the EAGLE root, the MTP root)."""
    eagle, mtp = tmp_path_factory.mktemp("eagle_tp"), tmp_path_factory.mktemp("mtp_tp")
    target, draft = target_and_draft(eagle, "eagle3")
    cases = {"eagle3": ("eagle3", target, draft), "mtp": ("mtp", with_mtp_layer(mtp), None)}
    out = tmp_path_factory.mktemp("draft_tp")
    run_ranks(cases, PROMPTS, out)
    return out, eagle, mtp


def results(out: Path, name: str) -> list[dict]:
    return [torch.load(result_path(out, name, rank), weights_only=False) for rank in range(SIZE)]


def check_proposal(saved: dict, key: str, first: int, topk_p, topk_index, hidden) -> None:  # type: ignore[no-untyped-def]
    token, draft = saved[key]
    assert token == first and list(draft.topk_index) == topk_index.tolist()
    torch.testing.assert_close(torch.tensor(draft.topk_p), topk_p, atol=TOL, rtol=0)
    got = torch.frombuffer(bytearray(draft.hidden), dtype=torch.float32)
    torch.testing.assert_close(got, hidden, atol=TOL, rtol=0)


def test_eagle3_at_tp2_equals_the_reference(ranks):
    out, root, _ = ranks
    per_rank = results(out, "eagle3")
    target, tensors = hf_model(root / "target"), load_file(root / "eagle3" / "model.safetensors")
    assert test_eagle_draft.TOPK == TOPK
    for key, ids in PROMPTS.items():
        first, topk_p, topk_index, hidden, k, v = test_eagle_draft.reference(
            "eagle3", target, tensors, ids
        )
        for saved in per_rank:
            check_proposal(saved, key, first, topk_p, topk_index, hidden)
            assert saved[f"{key}_kv"][0].shape == (len(ids), KV_HEADS // SIZE, 16)  # its head
        for index, expected in ((0, k), (1, v)):
            whole = gather_kv_heads([saved[f"{key}_kv"][index] for saved in per_rank], KV_HEADS)
            torch.testing.assert_close(whole, expected, atol=TOL, rtol=0)


def test_mtp_at_tp2_equals_the_reference(ranks):
    out, _, root = ranks
    per_rank = results(out, "mtp")
    hf = (hf_model(root / "target"), hf_model(root / "donor"))
    tensors = load_file(root / "target" / "model.safetensors")
    assert test_mtp_draft.TOPK == TOPK
    for key, ids in PROMPTS.items():
        first, topk_p, topk_index, hidden, rows = test_mtp_draft.reference(hf, tensors, ids)
        for saved in per_rank:
            check_proposal(saved, key, first, topk_p, topk_index, hidden)
            torch.testing.assert_close(saved[f"{key}_kv"][0][:, 0], rows, atol=TOL, rtol=0)
