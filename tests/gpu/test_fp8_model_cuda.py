"""A tiny FP8 DeepSeek-V3 (``tests/fp8_gemm_model.py``: 128 × 128 blocks) forward on CUDA with
the registry's own choice, the block-scaled GEMM (``block_gemm``: torch's blockwise
``scaled_mm``), against the same checkpoint dequantized at load. Skipped without a Hopper GPU
and a torch that has the kernel (``find_kernel``); never run on this project's CI machine (no
GPU). CPU coverage of the same wiring: tests/integration/model/test_fp8_block_gemm.py.

* the registry picks ``block_gemm`` on this device and the model holds its projections as
  ``Fp8BlockWeight`` (e4m3 on the GPU, no stand-in kernel), its experts on ``grouped``;
* in a real forward every kernel call is within 1% (norm) of the kernel's float32 arithmetic
  on the same input (``reference_linear``) and within FP8's error (< 4%) of the dequantized
  linear;
* the whole forward's logits and latent rows are no further (norm) from the dequantized
  model's than the kernel's own arithmetic run on the CPU in float32 is (× 1.5, + bf16's
  0.02): the error is FP8's, amplified by the random model alike on both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.model import build
from prefill_worker.model.quant.backends import BlockGemm, create_fp8_backend
from prefill_worker.model.quant.block_gemm import (
    Fp8BlockWeight,
    block_fp8_linear,
    find_kernel,
    reference_linear,
)
from tests.checkpoints import prompt
from tests.fp8_gemm_model import NUM_KEPT, NUM_PAGES, PAGE_SIZE, Recorder, forward, make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(find_kernel() is not None, reason=f"no blockwise kernel: {find_kernel()}"),
]
IDS = prompt(24, seed=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fp8_gemm_cuda"))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_the_registry_keeps_fp8_and_the_experts_run_grouped(checkpoint):
    runner, _, info = build(checkpoint, dtype="bfloat16", device="cuda", page_size=PAGE_SIZE,
                            num_pages=NUM_PAGES)  # fmt: skip
    weights = runner.model.weights  # type: ignore[attr-defined]
    attn, moe = weights.layers[0].attn, weights.layers[1].mlp
    for weight in (attn.q_a, attn.q_b, attn.o, moe.gate_up, moe.down):
        assert isinstance(weight, Fp8BlockWeight) and weight.kernel is None
        assert weight.weight.dtype == torch.float8_e4m3fn and weight.weight.is_cuda
    assert isinstance(attn.kv_b, torch.Tensor) and attn.kv_b.dtype == torch.bfloat16
    assert info.moe_backend == "grouped"


def test_every_kernel_call_in_a_forward_is_the_reference(checkpoint):
    pairs: list[float] = []

    def kernel(x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
        got = block_fp8_linear(x, w, x.dtype)
        pairs.append(relative(got.float(), reference_linear(x, w)))
        return got

    recorder = Recorder(kernel)
    logits, _, _ = forward(checkpoint, BlockGemm(recorder), IDS, "bfloat16", "cuda")
    assert len(pairs) >= NUM_KEPT and torch.isfinite(logits).all()
    assert max(pairs) < 0.01, pairs
    assert max(recorder.errors) < 0.04, recorder.errors


def test_the_forward_is_within_fp8_error_of_the_dequantized_model(checkpoint):
    cpu_plain = forward(checkpoint, create_fp8_backend("dequantize"), IDS)
    cpu_fp8 = forward(checkpoint, BlockGemm(Recorder("reference")), IDS)
    plain = forward(checkpoint, create_fp8_backend("dequantize"), IDS, "bfloat16", "cuda")
    fp8 = forward(checkpoint, BlockGemm(), IDS, "bfloat16", "cuda")
    bound = 1.5 * relative(cpu_fp8[0], cpu_plain[0]) + 0.02
    assert relative(fp8[0], plain[0]) < bound
    for layer in range(len(plain[1])):
        bound = 1.5 * relative(cpu_fp8[1][layer], cpu_plain[1][layer]) + 0.02
        assert relative(fp8[1][layer], plain[1][layer]) < bound, layer
