"""The runner on CUDA against transformers on the CPU, fp32: every family, a prompt chunked
over a cached prefix and a second request in the last batch (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.model import build
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import (
    FAMILIES,
    PAGE_SIZE,
    chunk,
    hf_forward,
    hf_model,
    paged_kv,
    plan,
    prompt,
    scattered_pages,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 2e-3  # fp32 on CUDA (no TF32) against fp32 on the CPU: summation order differs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-ckpt")
    return {family: make_checkpoint(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_on_cuda_matches_transformers(checkpoints, family):
    torch.backends.cuda.matmul.allow_tf32 = False
    ids, other = prompt(300, seed=3), prompt(20, seed=4)
    hf_logits, hf_kv = hf_forward(hf_model(checkpoints[family]), ids)
    runner, kv_cache, _ = build(
        checkpoints[family], "float32", "cuda", "sdpa", PAGE_SIZE, num_pages=96
    )
    pages = scattered_pages(0, -(-len(ids) // PAGE_SIZE))
    other_pages = scattered_pages(1, -(-len(other) // PAGE_SIZE))
    for start in range(0, len(ids), 64):
        end = min(start + 64, len(ids))
        chunks = [chunk("long", ids, start, end, pages, last=end == len(ids))]
        if end == len(ids):
            chunks.insert(0, chunk("short", other, 0, len(other), other_pages, last=True))
        logits = runner.compute_logits(plan(*chunks))
    torch.testing.assert_close(logits[1].cpu(), hf_logits[-1], atol=TOL, rtol=0)
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        k, v = paged_kv(kv_cache, pages, len(ids), layer)
        torch.testing.assert_close(k.cpu(), hf_k, atol=TOL, rtol=0)
        torch.testing.assert_close(v.cpu(), hf_v, atol=TOL, rtol=0)
