"""flashinfer's fused MoE against the grouped torch backend on the same CUDA bf16 inputs, and
a Qwen3-MoE checkpoint through the runner on CUDA (auto picks flashinfer) against our own CPU
fp32 run (skipped without CUDA and flashinfer)."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.model import build
from prefill_worker.model.moe import create_moe_backend, has_flashinfer_moe
from prefill_worker.model.moe.block import MoEWeights
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import chunk, ours, plan, prompt, scattered_pages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not has_flashinfer_moe(), reason="needs CUDA + flashinfer"
    ),
]


def test_fused_kernel_equals_grouped_torch():
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, hidden, inter, experts, top_k = 300, 256, 128, 8, 2
    x = torch.randn(num_tokens, hidden, device=device, generator=g).to(dtype)
    ids = torch.rand(num_tokens, experts, device=device, generator=g).topk(top_k).indices
    weights = torch.rand(num_tokens, top_k, device=device, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device, generator=g) / 16).to(dtype)
    down = (torch.randn(experts, hidden, inter, device=device, generator=g) / 11).to(dtype)
    layer = MoEWeights(x.new_empty(experts, hidden), None, gate_up, down, None, None)
    fused = create_moe_backend("flashinfer", device, dtype)
    prepared = fused.prepare(layer)
    got = fused.experts(x, weights, ids, prepared.gate_up, prepared.down)
    want = create_moe_backend("grouped", device, dtype).experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_qwen3_moe_runner_on_cuda_agrees_with_the_cpu(tmp_path):
    path = make_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    ids = prompt(70, seed=1)
    pages = scattered_pages(0, 5)
    want = ours(path)[0].compute_logits(plan(chunk("a", ids, 0, 70, pages, last=True)))[0]
    runner, _, _ = build(path, dtype="bfloat16", device="cuda", page_size=16, num_pages=96)
    assert runner.model.experts.name == "flashinfer"
    got = runner.compute_logits(plan(chunk("a", ids, 0, 70, pages, last=True)))[0].float().cpu()
    torch.testing.assert_close(got, want, atol=0.15, rtol=0)  # bf16 against fp32
