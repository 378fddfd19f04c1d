"""The MoE backend registry's choices, and the grouped backend against the naive one."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.model.moe import create_moe_backend, resolve_moe_backend_name

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_is_the_grouped_backend_off_cuda_or_in_fp32():
    assert resolve_moe_backend_name("auto", CPU, torch.bfloat16) == "grouped"
    assert resolve_moe_backend_name("auto", CUDA, torch.float32) == "grouped"  # no fp32 kernel


@pytest.mark.parametrize(("device", "dtype"), [(CPU, torch.bfloat16), (CUDA, torch.float32)])
def test_flashinfer_is_refused_off_cuda_or_in_fp32(device, dtype):
    with pytest.raises(ValueError, match="needs a CUDA device and bf16/fp16"):
        resolve_moe_backend_name("flashinfer", device, dtype)


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown MoE backend 'triton'"):
        resolve_moe_backend_name("triton", CPU, torch.float32)


def test_grouped_equals_every_expert_over_every_token():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(50)])  # [T, 2]
    ids[:10] = torch.tensor([0, 1])  # expert 5 may go unused; 0 and 1 are crowded
    weights = torch.rand(50, 2, generator=g)
    gate_up, down = torch.randn(6, 24, 16, generator=g), torch.randn(6, 16, 12, generator=g)
    grouped = create_moe_backend("grouped", CPU).experts(x, weights, ids, gate_up, down)
    naive = create_moe_backend("naive", CPU).experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(grouped, naive, atol=1e-5, rtol=1e-5)
