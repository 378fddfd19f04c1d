"""The block-scaled FP8 GEMM on CUDA (``model.quant.block_gemm``, torch's blockwise
``scaled_mm``) against its float32 reference: DeepSeek-V3's shapes at TP 8 (q_b 3072 × 1536,
an expert's gate/up 512 × 7168, o 7168 × 2048) for a few token counts, bf16 out. Skipped
without a Hopper GPU and a torch that has the kernel (``find_kernel``); never run on this
project's CI machine (no GPU)."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.model.quant.block_gemm import (
    Fp8BlockWeight,
    block_fp8_linear,
    find_kernel,
    reference_linear,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(find_kernel() is not None, reason=f"no blockwise kernel: {find_kernel()}"),
]


@pytest.mark.parametrize(("n", "k"), [(3072, 1536), (512, 7168), (7168, 2048)])
@pytest.mark.parametrize("m", [1, 37, 512])
def test_the_kernel_computes_the_reference(m: int, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    values = torch.randn(n, k, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(n // 128, k // 128, generator=generator) / 50 + 1e-3
    cpu = Fp8BlockWeight(values, scales)
    cuda = Fp8BlockWeight(values.cuda(), scales.cuda())
    got = block_fp8_linear(x.cuda(), cuda).float().cpu()
    want = reference_linear(x, cpu)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
