"""gpt-oss's MXFP4 experts on flashinfer's W4A16 MoE (kept as shipped) against the same
checkpoint dequantized at load (the torch path), on an SM90 GPU (skipped elsewhere): the tiny
gpt_oss checkpoint (hidden 96, intermediate 64: both padded to 128) with its experts as
MXFP4, a prompt of 150 tokens in two chunks. bf16 (the kernel's): the last-token logits at
most twice the torch path's own bf16 error (+ 0.01) against the torch path in fp32; the
experts' bytes on the device are the packed stacks' (no dequantized copy)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.gpt_oss import GptOssMxfp4Experts
from prefill_worker.request import SamplingParams
from tests.checkpoints import make_checkpoint, prompt
from tests.mxfp4_checkpoints import quantized

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an SM90 GPU (flashinfer's W4A16 MoE)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed"
    ),
]


def test_gpt_oss_mxfp4_kernel_matches_dequantized(tmp_path):
    packed, _ = quantized(make_checkpoint("gpt_oss", tmp_path / "ckpt"), tmp_path)
    ids, pages = prompt(150, seed=3), list(range(20, 10, -1))
    outputs = {}
    for moe, dtype in (("grouped", "float32"), ("grouped", "bfloat16"), ("auto", "bfloat16")):
        runner, _, info = build(packed, dtype, "cuda", "sdpa", 16, num_pages=24, moe_backend=moe)
        kept = moe == "auto"
        want = "experts=flashinfer_mxfp4" if kept else "experts=torch"
        assert info.kernel_paths[0].startswith(want), info.kernel_paths
        experts = runner.model.weights.layers[0].experts
        assert isinstance(experts, GptOssMxfp4Experts) == kept
        runner.compute_logits(BatchPlan(0, (ChunkPlan("a", ids[:64], 0, 64, pages, None),)))
        last = ChunkPlan("a", ids[64:], 64, 150, pages, SamplingParams())
        outputs[moe, dtype] = runner.compute_logits(BatchPlan(1, (last,)))[0].float()
    reference = outputs["grouped", "float32"]
    torch_err = float((outputs["grouped", "bfloat16"] - reference).abs().max())
    kernel_err = float((outputs["auto", "bfloat16"] - reference).abs().max())
    assert kernel_err <= 2 * torch_err + 1e-2, (kernel_err, torch_err)
