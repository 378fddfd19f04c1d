"""The flashinfer MoE backend (its fused CUTLASS kernel) against the grouped torch backend on
CUDA (skipped without one): the experts call, then the whole qwen3_moe tiny model. bf16 (the
kernel has no fp32 path), held to at most twice grouped's own bf16 error (+ 0.01) against
grouped in fp32."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.moe import MoEWeights, create_moe_backend
from prefill_worker.request import SamplingParams
from tests.checkpoints import make_checkpoint, prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed"
    ),
]

CUDA = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 256, 128


def _errors(outputs: dict[tuple[str, torch.dtype], torch.Tensor]) -> dict[str, float]:
    reference = outputs["grouped", torch.float32]
    return {
        name: float((outputs[name, torch.bfloat16] - reference).abs().max())
        for name in ("grouped", "flashinfer")
    }


def test_flashinfer_experts_match_grouped():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(300, HIDDEN, generator=gen, device=CUDA)
    cpu_gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(EXPERTS, generator=cpu_gen)[:TOP_K] for _ in range(300)])
    ids[:40] = torch.tensor([0, 1])  # a crowded pair; some experts see few tokens
    ids = ids.to(CUDA)
    weights = torch.rand(300, TOP_K, generator=gen, device=CUDA)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=CUDA) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=CUDA) / INTER**0.5
    outputs = {}
    for name, dtype in (
        ("grouped", torch.float32),
        ("grouped", torch.bfloat16),
        ("flashinfer", torch.bfloat16),
    ):
        backend = create_moe_backend(name, CUDA, dtype)
        stacks = (gate_up.to(dtype), down.to(dtype))
        prepared = backend.prepare(_weights(*stacks))
        out = backend.experts(x.to(dtype), weights.to(dtype), ids, prepared.gate_up, prepared.down)
        outputs[name, dtype] = out.float()
    errors = _errors(outputs)
    assert errors["flashinfer"] <= 2 * errors["grouped"] + 1e-2, errors


def _weights(gate_up: torch.Tensor, down: torch.Tensor) -> MoEWeights:
    router = torch.zeros(EXPERTS, HIDDEN, device=CUDA, dtype=gate_up.dtype)
    return MoEWeights(router, None, gate_up, down, None, None)


def test_qwen3_moe_with_flashinfer_matches_grouped(tmp_path):
    """The whole model, a prompt in two chunks: the last-token logits."""
    ckpt = make_checkpoint(
        "qwen3_moe", tmp_path / "ckpt", hidden_size=128, moe_intermediate_size=128
    )
    ids, pages = prompt(150, seed=3), list(range(20, 10, -1))
    outputs = {}
    for name, dtype in (
        ("grouped", "float32"),
        ("grouped", "bfloat16"),
        ("flashinfer", "bfloat16"),
    ):
        runner, _, info = build(ckpt, dtype, "cuda", "sdpa", 16, num_pages=24, moe_backend=name)
        assert info.moe_backend == name
        runner.compute_logits(BatchPlan(0, (ChunkPlan("a", ids[:64], 0, 64, pages, None),)))
        last = ChunkPlan("a", ids[64:], 64, 150, pages, SamplingParams())
        logits = runner.compute_logits(BatchPlan(1, (last,)))
        outputs[name, getattr(torch, dtype)] = logits[0].float()
    errors = _errors(outputs)
    assert errors["flashinfer"] <= 2 * errors["grouped"] + 1e-2, errors
