"""FP8 dequantization of one rank's slice: each element times the scale of its block (or
channel, or tensor) in the full tensor, whichever cut the split makes; the backend registry
and the block-alignment rule a GEMM backend would apply."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.model.quant.backends import create_fp8_backend, misaligned_cut
from prefill_worker.model.quant.fp8 import dequantize
from prefill_worker.model.quant.spec import BLOCK, CHANNEL, TENSOR, QuantSpec

BLOCKS = QuantSpec("fp8", BLOCK, "weight_scale_inv", (4, 8))


def reference(fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Element by element: the scale of the block it sits in."""
    out = torch.empty(fp8.shape)
    for i in range(fp8.shape[0]):
        for j in range(fp8.shape[1]):
            out[i, j] = fp8[i, j].float() * scale[i // block[0], j // block[1]]
    return out


@pytest.fixture
def weight() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fp8 = (torch.randn(10, 20, generator=g) * 50).to(torch.float8_e4m3fn)  # partial blocks
    return fp8, torch.rand(3, 3, generator=g) + 0.5  # [ceil(10/4), ceil(20/8)]


def test_whole_tensor(weight):
    fp8, scale = weight
    torch.testing.assert_close(dequantize(fp8, scale, BLOCKS, None, slice(None)),
                               reference(fp8, scale, (4, 8)), rtol=0, atol=0)  # fmt: skip


CUTS = [(0, slice(0, 5)), (0, slice(5, 10)), (0, slice(2, 7)),
        (1, slice(0, 10)), (1, slice(10, 20)), (1, slice(3, 13))]  # fmt: skip


@pytest.mark.parametrize(("dim", "cut"), CUTS)
def test_a_slice_equals_the_same_slice_of_the_whole(weight, dim, cut):
    """Cuts through the middle of blocks: the slice keeps the full tensor's scales."""
    fp8, scale = weight
    whole = reference(fp8, scale, (4, 8))
    piece = fp8[cut] if dim == 0 else fp8[:, cut]
    expected = whole[cut] if dim == 0 else whole[:, cut]
    torch.testing.assert_close(dequantize(piece, scale, BLOCKS, dim, cut), expected, rtol=0, atol=0)


def test_channel_and_tensor_scales(weight):
    fp8, _ = weight
    rows = torch.arange(1.0, 11.0)[:, None]  # [10, 1]
    channel = QuantSpec("compressed-tensors", CHANNEL, "weight_scale")
    got = dequantize(fp8[4:8], rows, channel, 0, slice(4, 8))
    torch.testing.assert_close(got, fp8[4:8].float() * rows[4:8], rtol=0, atol=0)
    got = dequantize(fp8[:, 3:9], rows, channel, 1, slice(3, 9))  # a column cut: every row's
    torch.testing.assert_close(got, fp8[:, 3:9].float() * rows, rtol=0, atol=0)
    tensor = QuantSpec("compressed-tensors", TENSOR, "weight_scale")
    got = dequantize(fp8, torch.tensor([0.25]), tensor, None, slice(None))
    torch.testing.assert_close(got, fp8.float() * 0.25, rtol=0, atol=0)


def test_the_registry_has_dequantize_and_names_what_it_has():
    fp8, scale = torch.ones(4, 8).to(torch.float8_e4m3fn), torch.full((1, 1), 3.0)
    out = create_fp8_backend("dequantize").prepare("w", fp8, scale, BLOCKS, None, slice(None))
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.full((4, 8), 3.0))
    registered = r"\(registered: dequantize, block_gemm\)"
    with pytest.raises(ValueError, match=r"'cutlass' is not registered " + registered):
        create_fp8_backend("cutlass")


def test_misaligned_cuts_are_named():
    assert misaligned_cut(BLOCKS, "w", 0, slice(4, 8), 10) is None
    assert misaligned_cut(BLOCKS, "w", 0, slice(8, 10), 10) is None  # the partial last block
    assert misaligned_cut(BLOCKS, "w", 1, slice(0, 16), 20) is None
    reason = misaligned_cut(BLOCKS, "q_b_proj.weight", 0, slice(0, 6), 10)
    assert str(reason).startswith("tensor q_b_proj.weight: this rank's rows [0, 6) cut a "
                                  "4-wide scale block; the block-scaled FP8 GEMM needs whole "
                                  "blocks per rank")  # fmt: skip
    assert "columns [3, 13)" in str(misaligned_cut(BLOCKS, "w", 1, slice(3, 13), 20))
    assert misaligned_cut(QuantSpec("c", CHANNEL, "weight_scale"), "w", 0, slice(1, 2), 9) is None
