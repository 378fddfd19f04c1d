"""flashinfer's GDN prefill kernel (``gdn_rule.FlashInferDeltaRule``) against the torch delta
rule on CUDA (skipped without a GPU the kernel runs on: SM90, or SM100 with CUDA 13): the
rule alone over three spans (a fresh prompt, a continued one, one past a 64-token block),
then the whole qwen3_next tiny model (linear head size 128, what both kernels take;
attention head size 64, flashinfer attention's), a prompt in two
chunks so the state crosses from one to the next in its slot. bf16 (the kernel's dtype): the
rule's outputs and states within 3% of the largest value of the torch rule's; the model's
last-token logits at most twice the torch path's own bf16 error (+ 0.01) against fp32."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.gdn import TORCH_RULE, StateSpan
from prefill_worker.model.gdn_rule import linear_rule_choice
from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.request import SamplingParams
from tests.checkpoints import make_checkpoint, prompt

CUDA = torch.device("cuda")


def _kernel_applies() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        return False
    spec = LinearAttentionSpec(("linear_attention",), 2, 4, 128, 128, 4, 16, True)
    cap = torch.cuda.get_device_capability()
    name, _ = linear_rule_choice("flashinfer", CUDA, torch.bfloat16, spec, cap,
                                 torch.version.cuda, True)  # fmt: skip
    return name == "flashinfer"


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _kernel_applies(), reason="needs flashinfer's GDN kernel (SM90/100)"),
]


def test_flashinfer_rule_matches_torch_rule():
    from prefill_worker.model.gdn_rule import FlashInferDeltaRule

    gen = torch.Generator(device=CUDA).manual_seed(0)
    n, hk, hv, d = 200, 2, 4, 128
    q, k = (torch.randn(n, hk, d, generator=gen, device=CUDA).bfloat16() for _ in "qk")
    v = torch.randn(n, hv, d, generator=gen, device=CUDA).bfloat16()
    g = -torch.rand(n, hv, generator=gen, device=CUDA) * 0.5
    beta = torch.rand(n, hv, generator=gen, device=CUDA).bfloat16()
    spans = (StateSpan(0, 40, 2, True), StateSpan(40, 47, 0, False), StateSpan(47, 200, 3, True))
    slots = torch.randn(5, hv, d, d, generator=gen, device=CUDA) * 0.05
    want_state, got_state = slots.clone(), slots.clone()
    want = TORCH_RULE(q, k, v, g, beta, spans, want_state).float()
    got = FlashInferDeltaRule()(q, k, v, g, beta, spans, got_state).float()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got_state - want_state).abs().max() <= 0.03 * want_state.abs().max()
    assert torch.equal(got_state[[1, 4]], slots[[1, 4]])


def test_qwen3_next_with_the_kernel_matches_torch(tmp_path):
    ckpt = make_checkpoint(
        "qwen3_next",
        tmp_path / "ckpt",
        head_dim=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    ids, pages = prompt(150, seed=3), list(range(20, 10, -1))
    outputs = {}
    for backend, dtype in (("sdpa", "float32"), ("sdpa", "bfloat16"), ("flashinfer", "bfloat16")):
        runner, _, info = build(ckpt, dtype, "cuda", backend, 16, num_pages=24)
        want = "gdn=flashinfer" if backend == "flashinfer" else "gdn=torch"
        assert info.kernel_paths[0].startswith(want), info.kernel_paths
        first = ChunkPlan("a", ids[:80], 0, 80, pages, None, state_slot=3)
        runner.compute_logits(BatchPlan(0, (first,)))
        last = ChunkPlan("a", ids[80:], 80, 150, pages, SamplingParams(), state_slot=3)
        outputs[backend, dtype] = runner.compute_logits(BatchPlan(1, (last,)))[0].float()
    reference = outputs["sdpa", "float32"]
    torch_err = float((outputs["sdpa", "bfloat16"] - reference).abs().max())
    kernel_err = float((outputs["flashinfer", "bfloat16"] - reference).abs().max())
    assert kernel_err <= 2 * torch_err + 1e-2, (kernel_err, torch_err)
