"""The block-scaled FP8 GEMM's parts that need no GPU (``model.quant.block_gemm``): the
activation quantization (per token, 128 columns a scale), the scale layouts torch's blockwise
``scaled_mm`` checks (its shape check runs on the ``meta`` device: a row-major layout is
refused, ours passes), the reference arithmetic against the dequantized weight, and where
the kernel is found. The kernel itself: tests/gpu/test_block_gemm_cuda.py (no GPU here)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

from prefill_worker.model.quant.block_gemm import (
    FP8_MAX,
    Fp8BlockWeight,
    act_quant,
    find_kernel,
    reference_linear,
    scale_layouts,
)
from prefill_worker.model.quant.fp8 import dequantize
from prefill_worker.model.quant.spec import BLOCK, QuantSpec

E4M3 = torch.float8_e4m3fn
SPEC = QuantSpec("fp8", BLOCK, "weight_scale_inv", (128, 128))


def weight(rows: int, columns: int, seed: int = 0) -> Fp8BlockWeight:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, columns, generator=generator).to(E4M3)
    scales = torch.rand(-(-rows // 128), -(-columns // 128), generator=generator) / 100 + 1e-3
    return Fp8BlockWeight(values, scales)


def test_activations_are_quantized_per_token_per_128_columns() -> None:
    x = torch.randn(5, 300) * torch.tensor([1.0, 10.0, 0.01, 3.0, 100.0])[:, None]
    x[2, 128:256] = 0.0  # an all-zero group
    x8, sx = act_quant(x)
    assert x8.dtype == E4M3 and x8.shape == (5, 300) and sx.shape == (5, 3)
    back = x8.float() * sx.repeat_interleave(128, dim=1)[:, :300]
    assert ((back - x).abs() <= x.abs() * 2**-4).all()  # e4m3's 3 mantissa bits
    padded = torch.zeros(5, 384)
    padded[:, :300] = x
    amax = padded.view(5, 3, 128).abs().amax(dim=-1)  # [tokens, groups]
    x8_amax = torch.zeros(5, 384)
    x8_amax[:, :300] = x8.float().abs()
    assert torch.equal(sx[amax > 0], amax[amax > 0] / FP8_MAX)
    assert (x8_amax.view(5, 3, 128).amax(dim=-1) == torch.where(amax > 0, FP8_MAX, 0.0)).all()


def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize(("m", "k", "n"), [(40, 384, 256), (1, 128, 128), (7, 640, 384)])
def test_the_scale_layouts_pass_torchs_blockwise_check(m: int, k: int, n: int) -> None:
    x8, sx = act_quant(torch.randn(m, k))
    w = weight(n, k)
    scale_a, scale_b = scale_layouts(sx, w.scale_inv)
    k4 = -(-k // 128 // 4) * 4
    assert scale_a.stride() == (1, m) and scale_b.shape == (k4, n // 128)
    assert torch.equal(scale_b[: k // 128], w.scale_inv.t()) and not scale_b[k // 128 :].any()

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return scaled_mm(meta(x8), meta(w.weight).t(), meta(a), ScalingType.BlockWise1x128,
                         meta(b), ScalingType.BlockWise128x128, swizzle_a=SwizzleType.NO_SWIZZLE,
                         swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16)  # fmt: skip

    assert run(scale_a, scale_b).shape == (m, n)
    with pytest.raises(RuntimeError, match="blockwise scaling"):
        run(sx, w.scale_inv.t())  # the same values row-major: refused


def test_the_reference_is_the_quantized_activations_times_the_dequantized_weight() -> None:
    x, w = torch.randn(6, 256), weight(384, 256, seed=1)
    dense = dequantize(w.weight, w.scale_inv, SPEC, None, slice(None))  # the load path's
    got = reference_linear(x, w)
    x8, sx = act_quant(x)
    exact = (x8.float() * sx.repeat_interleave(128, dim=1)) @ dense.t()
    assert (got - exact).abs().max() < 1e-5 * exact.abs().max()
    unquantized = x @ dense.t()
    assert 0 < (got - unquantized).abs().max() < 0.05 * unquantized.abs().max()


def test_scales_must_cover_the_weight_in_blocks() -> None:
    with pytest.raises(ValueError, match=r"needs scales of \[2, 1\], got \[1, 1\]"):
        Fp8BlockWeight(torch.zeros(256, 128, dtype=E4M3), torch.ones(1, 1))


def test_the_kernel_is_not_found_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: tests/gpu/test_block_gemm_cuda.py")
    assert find_kernel() == "no CUDA device"
