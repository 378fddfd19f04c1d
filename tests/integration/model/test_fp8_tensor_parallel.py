"""FP8 checkpoints at tensor parallel 2 (real gloo groups of CPU processes, ``tp_ranks``):
each rank reads its slice of every FP8 weight and dequantizes it with the scale rows and
columns of the blocks it sits in.

The block sizes are chosen so that the splits cut blocks in two: DeepSeek-V3 in 32 × 32 blocks
(``q_b_proj``'s 96 rows cut at 48, ``kv_b_proj``'s 160 at 80, ``o_proj``'s 96 columns at 48,
each expert's 32 gate/up rows at 16) and Qwen3 in 48 × 48 (q's 128 rows cut at 64, the MLP's
128 at 64): a rank that took its scale rows as ``cut // block`` of its own slice, or as the
slice's share of the scale tensor, would scale those rows with a neighbour's factor. Every
rank's last-token logits and the K/V (reassembled by the head rule; the MLA latent, the same
on both ranks) are within 1e-4 of transformers on the dequantized weights, in float32.

The same world runs a DeepSeek-V3 in 128 × 128 blocks (``tests/fp8_gemm_model.py``) on the
block-GEMM path (FP8 kept as shipped, each rank its blocks and their scales; the kernel a CPU
stand-in, the dequantized linear: ``tp_ranks.block_gemm_on_cpu``): o and down sum the ranks'
GEMM outputs, and the logits and latent rows of the prompt that reads a cached prefix
back (``hit``) are within 1e-4 of transformers likewise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.model.parallel import gather_kv_heads
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.fp8_gemm_model import make_checkpoint as make_128_block_checkpoint
from tests.integration.model.conftest import hf_forward, hf_mla_forward, hf_model, prompt
from tests.integration.model.tp_ranks import (
    GEMM_SUFFIX,
    SPLIT,
    Prompts,
    result_path,
    run_world,
)

TOL = 1e-4
CASES = {"deepseek_v3": (32, 32), "qwen3": (48, 48)}
GEMM = "deepseek_v3" + GEMM_SUFFIX  # 128-blocks on the block-GEMM path
LONG, SHORT = prompt(45, seed=1), prompt(20, seed=2)
PROMPTS = Prompts(LONG, SHORT, LONG[:SPLIT] + prompt(11, seed=3))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fp8_tp")
    out = {family: make_fp8_checkpoint(family, root / family, block=block)
           for family, block in CASES.items()}  # fmt: skip
    gemm = make_128_block_checkpoint(root / "gemm")
    return out | {GEMM: (gemm, gemm.parent / "reference")}


@pytest.fixture(scope="module")
def world(checkpoints) -> Path:  # type: ignore[no-untyped-def]
    out = checkpoints["qwen3"][0].parent.parent / "results"
    out.mkdir()
    run_world({2: {family: paths[0] for family, paths in checkpoints.items()}}, PROMPTS, out)
    return out


@pytest.mark.parametrize("case", [*sorted(CASES), GEMM])
def test_logits_and_kv_match_transformers_at_tp2(checkpoints, world, case):
    model = hf_model(checkpoints[case][1])
    family = case.removesuffix(GEMM_SUFFIX)
    results = [torch.load(result_path(world, case, 2, rank)) for rank in range(2)]
    for result in results:  # 2 forwards × (q_a, q_b, o ×2, dense, shared, ≥ 1 expert's 2)
        assert result["gemm_calls"] >= 24 if case == GEMM else result["gemm_calls"] == 0
    for key in ("hit",) if case == GEMM else ("long", "short", "hit"):  # hit: a prefix read
        ids = getattr(PROMPTS, key)
        if family == "deepseek_v3":
            hf_logits, hf_rows = hf_mla_forward(model, ids)
        else:
            hf_logits, hf_kv = hf_forward(model, ids)
        for result in results:
            torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        if family == "deepseek_v3":
            for layer, expected in enumerate(hf_rows):
                rows = [result[f"{key}_kv"][layer][0][:, 0] for result in results]
                assert torch.equal(rows[0], rows[1])
                torch.testing.assert_close(rows[0], expected, atol=TOL, rtol=1e-5)
            continue
        for layer, (hf_k, hf_v) in enumerate(hf_kv):
            for index, hf_part in ((0, hf_k), (1, hf_v)):
                per_rank = [result[f"{key}_kv"][layer][index] for result in results]
                whole = gather_kv_heads(per_rank, 2)
                torch.testing.assert_close(whole, hf_part, atol=TOL, rtol=0)
