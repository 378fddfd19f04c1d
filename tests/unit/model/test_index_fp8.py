"""The DSA index keys in SGLang's FP8 layout (``model.index_fp8``) against an independent
transcription of SGLang 0.5.23's CUDA rule (``fused_store_index_cache.cuh``: fp32 arithmetic,
``__nv_cvt_float2_to_fp8x2`` rounding to nearest even), here in numpy with its own e4m3
encoder; SGLang's kernels need a GPU, so the rule is compared, not called."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_worker.model.hf_dsa import IndexerSpec
from prefill_worker.model.index_cache import IndexCache
from prefill_worker.model.index_fp8 import dequantize, page_bytes, quantize

F32 = np.float32


def e4m3(value: float) -> int:
    """The e4m3fn code of ``value`` (|value| <= 448), nearest, ties to even."""
    sign = 0x80 if np.signbit(value) else 0
    a = abs(float(value))
    if a < 2.0**-6:  # subnormal: steps of 2^-9 (8 steps make the first normal)
        return sign | int(np.rint(a / 2.0**-9))
    exp = int(np.floor(np.log2(a)))
    mant = int(np.rint((a / 2.0**exp - 1.0) * 8))
    if mant == 8:
        exp, mant = exp + 1, 0
    return sign | (exp + 7) << 3 | mant


def reference(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's kernel, per token: scale = max(1e-4, amax) / 448, code = e4m3(clip(k * (1 /
    scale)))."""
    x = keys.astype(F32)
    scale = np.maximum(F32(1e-4), np.abs(x).max(axis=1)) / F32(448.0)
    inv = F32(1.0) / scale
    scaled = np.clip(x * inv[:, None], F32(-448.0), F32(448.0))
    codes = np.vectorize(e4m3, otypes=[np.uint8])(scaled)
    return codes, scale.astype(F32)


def keys_with_edges() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 128, generator=g) * torch.tensor([1e-3, 0.1, 1, 3, 50, 1e4])[:, None]
    zero = torch.zeros(1, 128)  # amax floored at 1e-4
    ties = torch.zeros(1, 128)  # scale 1: midpoints between codes, normal and subnormal
    ties[0, :8] = torch.tensor([448.0, 1.0625, 1.1875, -2.125, 2.0**-10, 3 * 2.0**-10, 0.0, -0.0])
    return torch.cat([rows, zero, ties])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_and_scales_equal_sglangs_rule(dtype: torch.dtype) -> None:
    keys = keys_with_edges().to(dtype)
    codes, scale = quantize(keys)
    want_codes, want_scale = reference(keys.float().numpy())
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32
    assert np.array_equal(codes.numpy(), want_codes)
    assert np.array_equal(scale.numpy().view(np.uint32), want_scale.view(np.uint32))
    tie = codes[-1, :6].tolist()
    assert tie == [0x7E, 0x38, 0x3A, 0xC0, 0x00, 0x02]  # 448; ties to even both ways


def test_a_decode_reads_the_keys_back_within_fp8s_step() -> None:
    keys = keys_with_edges()[:6]
    back = dequantize(*quantize(keys))
    amax = keys.abs().amax(dim=1, keepdim=True)
    assert ((back - keys).abs() <= amax / 16).all()  # half an e4m3 step at the top binade


def test_pages_hold_keys_then_scales_as_sglangs_index_buffer() -> None:
    """Page p of an indexed layer: the page's 64 keys of 128 codes, then 64 fp32 scales."""
    spec = IndexerSpec(2, 128, 4, False, ("full", "shared", "full"))
    cache = IndexCache(spec, 64, torch.float32, torch.device("cpu"))
    cache.allocate(4)
    pages = cache.keep_fp8()
    keys = keys_with_edges()
    slots = torch.tensor([3 * 64 + 5, 64 + 63, 0, 1, 2, 3 * 64 + 6, 64, 130])
    cache.write(2, slots, keys)
    assert pages.num_bytes == 2 * 4 * page_bytes(64)
    raw = pages.read(1, [0, 1, 2, 3]).numpy()  # indexed layer 2 is the second
    codes, scale = reference(keys.numpy())
    for token, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, 64)
        assert np.array_equal(raw[page, offset * 128 : offset * 128 + 128], codes[token])
        at = 64 * 128 + 4 * offset
        assert raw[page, at : at + 4].view(F32)[0] == scale[token]
    assert not pages.read(0, [0, 1, 2, 3]).any()  # layer 0 untouched
    region = pages.regions("cpu")
    assert region.component.layer_ids == (0, 2)
    assert region.runs[1][1] == page_bytes(64) == 64 * 132
