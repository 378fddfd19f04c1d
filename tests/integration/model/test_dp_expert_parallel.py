"""Expert parallelism across attention-DP ranks (``ep_size`` = ``dp_size``), against the
TP-1 runner: real gloo groups of CPU processes (``dp_ep_ranks``, one world of 4 ranks).

The tiny random Qwen3-MoE (8 experts, top 2) and DeepSeek-V3 (16 experts in 4 groups, top
4, a shared expert, MLA) at DP 2 / EP 2 (side by side) and DP 4 / EP 4: each rank holds its
share of the experts and runs its own prompts, in lockstep with the others (rank 0 alone,
then the last rank alone, then all at once). Every prompt's greedy first token and its
logprob, and its K/V (MLA: latent rows) in every layer, equal the TP-1 runner's on the same
plans within 1e-4. The lockstep's invariant: every rank ran a forward in every step that any
rank had work in, so each rank's forwards plus idle forwards are the same count, and a rank
with nothing to do in a phase ran idle ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.model import build
from tests.checkpoints import make_checkpoint
from tests.integration.model.dp_ep_ranks import (
    NUM_PAGES,
    PAGE_SIZE,
    paged_kv,
    pages_of,
    plans,
    prompts,
    result_path,
    run_world,
)

TOL = 1e-4
FAMILIES = ("qwen3_moe", "deepseek_v3")
SIZES = (2, 4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dp_ep_ckpt")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def world(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp_ep")
    cases = {size: [(family, checkpoints[family]) for family in FAMILIES] for size in SIZES}
    run_world(cases, out)
    return out


@pytest.fixture(scope="module")
def tp1(checkpoints: dict[str, Path]) -> dict[tuple[str, str], dict[str, object]]:
    """(family, prompt) -> the TP-1 runner's first token, logprob and K/V, the same plans."""
    out = {}
    for family, checkpoint in checkpoints.items():
        runner, kv_cache, info = build(
            checkpoint, dtype="float32", page_size=PAGE_SIZE, num_pages=NUM_PAGES
        )
        for key, ids in prompts(max(SIZES)).items():  # each read back before the next runs
            for plan in plans(key, ids):
                sampled = runner.run(plan).sampled
            out[family, key] = {
                "token": sampled[0].token_id,
                "logprob": sampled[0].logprob,
                "kv": paged_kv(kv_cache, pages_of(key), len(ids), info.num_layers),
            }
    return out


def results(out: Path, family: str, size: int) -> list[dict]:
    return [torch.load(result_path(out, family, size, rank)) for rank in range(size)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_s_prompts_equal_tp1(world, tp1, family: str, size: int) -> None:
    checked = 0
    for rank, saved in enumerate(results(world, family, size)):
        for key in [k.removesuffix("_token") for k in saved if k.endswith("_token")]:
            want = tp1[family, key]
            assert saved[f"{key}_token"] == want["token"], (rank, key)
            assert abs(saved[f"{key}_logprob"] - want["logprob"]) <= TOL, (rank, key)
            for layer, (got, expected) in enumerate(
                zip(saved[f"{key}_kv"], want["kv"], strict=True)
            ):
                for a, b in zip(got, expected, strict=True):
                    torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=f"{key} {layer}")
            checked += 1
    assert checked == size + 2  # long, short, and each rank's own


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_stepped_whenever_any_rank_had_work(world, family: str, size: int) -> None:
    counts = [saved["counts"] for saved in results(world, family, size)]
    busy = [c[0] for c in counts]
    assert busy == [3] + [1] * (size - 2) + [2]  # long's two chunks + own; short + own
    steps = {c[0] + c[1] for c in counts}
    assert len(steps) == 1, counts  # every step ran on every rank
    assert counts[0][1] >= 1 and counts[-1][1] >= 2, counts  # idle while another worked
    assert all(c[1] >= 3 for c in counts[1:-1]), counts
