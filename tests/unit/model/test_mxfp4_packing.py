"""gpt-oss's MXFP4 experts kept as shipped, on the CPU: which host keeps them (and why the
others dequantize), and the packing into the kernel's rows and padding checked against our
dequantizer: the packed gate_up stack dequantizes to the up rows then the gate rows, each
padded with zeros to a multiple of 128 rows and columns, the down stack to the down matrix
padded likewise, the biases following their rows; and the loader, told to keep them, holds
exactly that for a tiny MXFP4 checkpoint (bytes, not values: nothing dequantized). The
kernel's own byte/scale interleave and the kernel are proven on a GPU
(``tests/gpu/test_mxfp4_cuda.py``)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from prefill_worker.model.gpt_oss import GptOssExperts, GptOssMxfp4Experts
from prefill_worker.model.loader import load_checkpoint
from prefill_worker.model.moe.mxfp4 import (
    dequantize_mxfp4,
    dequantize_stack,
    mxfp4_experts_choice,
    pack_down,
    pack_gate_up,
)
from tests.checkpoints import make_checkpoint
from tests.mxfp4_checkpoints import quantized, to_mxfp4

CUDA, CPU, BF16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory):
    """The tiny gpt_oss checkpoint with its experts as MXFP4 (one per module)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    return quantized(make_checkpoint("gpt_oss", root / "ckpt"), root)[0]


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "mxfp4", "cap", "installed", "want"),
    [
        ("auto", CUDA, BF16, True, (9, 0), True, ("flashinfer", "SM90")),
        ("flashinfer", CUDA, BF16, True, (9, 0), True, ("flashinfer", "SM90")),
        ("grouped", CUDA, BF16, True, (9, 0), True, ("torch", "MoE backend grouped")),
        ("auto", CUDA, torch.float16, True, (9, 0), True, ("torch", "not float16")),
        ("auto", CUDA, BF16, True, (10, 0), True, ("torch", "SM100")),
        ("auto", CUDA, BF16, True, (8, 9), True, ("torch", "SM89")),
        ("auto", CUDA, BF16, True, (9, 0), False, ("torch", "not installed")),
        ("auto", CUDA, BF16, False, (9, 0), True, ("torch", "not MXFP4")),
        ("auto", CPU, BF16, True, None, False, ("torch", "on cpu")),
    ],
)
def test_mxfp4_is_kept_only_where_the_kernel_runs(
    backend, device, dtype, mxfp4, cap, installed, want
):
    name, why = mxfp4_experts_choice(backend, device, dtype, mxfp4, cap, installed)
    assert name == want[0] and want[1] in why, (name, why)
    if name == "flashinfer":  # and at tensor parallel 1 only
        name, why = mxfp4_experts_choice(backend, device, dtype, mxfp4, cap, installed, 2)
        assert name == "torch" and "tensor parallel 2" in why


def _shipped(experts: int, rows: int, cols: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks, scales = to_mxfp4(torch.randn(experts, rows, cols, generator=gen))
    bias = torch.randn(experts, rows, generator=gen)
    return blocks, scales, bias


def _dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(blocks, scales.to(torch.int32) - 127)


@pytest.mark.parametrize(("inter", "hidden"), [(64, 96), (128, 256), (160, 32)])
def test_gate_up_packs_as_up_rows_then_gate_rows_padded(inter, hidden):
    blocks, scales, bias = _shipped(3, 2 * inter, hidden, seed=inter)
    want = _dequantized(blocks, scales)  # [E, 2I, hidden], gate even rows, up odd rows
    stack = pack_gate_up(blocks, scales, bias)
    n_pad, k_pad = -(-inter // 128) * 128, -(-hidden // 128) * 128
    assert stack.blocks.shape == (3, 2 * n_pad, k_pad // 2) and stack.blocks.dtype == torch.uint8
    assert stack.scales.shape == (3, 2 * n_pad, k_pad // 32)
    got = dequantize_stack(stack)
    assert torch.equal(got[:, :inter, :hidden], want[:, 1::2])
    assert torch.equal(got[:, n_pad : n_pad + inter, :hidden], want[:, 0::2])
    assert torch.equal(stack.bias[:, :inter], bias[:, 1::2])
    assert torch.equal(stack.bias[:, n_pad : n_pad + inter], bias[:, 0::2])
    padding = torch.ones_like(got, dtype=torch.bool)
    padding[:, :inter, :hidden] = padding[:, n_pad : n_pad + inter, :hidden] = False
    assert not got[padding].any() and not stack.bias[:, inter:n_pad].any()


@pytest.mark.parametrize(("inter", "hidden"), [(64, 96), (256, 128)])
def test_down_packs_padded(inter, hidden):
    blocks, scales, bias = _shipped(2, hidden, inter, seed=hidden)
    stack = pack_down(blocks, scales, bias)
    n_pad, k_pad = -(-inter // 128) * 128, -(-hidden // 128) * 128
    got = dequantize_stack(stack)
    assert got.shape == (2, k_pad, n_pad)
    assert torch.equal(got[:, :hidden, :inter], _dequantized(blocks, scales))
    assert got[:, hidden:].abs().sum() == 0 and got[:, :, inter:].abs().sum() == 0
    assert torch.equal(stack.bias[:, :hidden], bias) and not stack.bias[:, hidden:].any()


def test_the_loader_keeps_the_shipped_bytes_packed(packed):
    """The same MXFP4 checkpoint loaded both ways: the kept stacks dequantize to the
    dequantized-at-load experts (gate rows first there, up rows first here)."""
    _, dense = load_checkpoint(packed, torch.float32, CPU)
    _, kept = load_checkpoint(packed, torch.float32, CPU, keep_mxfp4=True)
    for dense_layer, kept_layer in zip(dense.layers, kept.layers, strict=True):
        d, k = dense_layer.experts, kept_layer.experts
        assert isinstance(d, GptOssExperts) and isinstance(k, GptOssMxfp4Experts)
        assert k.stacks is not None
        gate_up, down = k.stacks
        inter, hidden = d.down.shape[2], d.down.shape[1]
        got = dequantize_stack(gate_up)
        assert torch.equal(got[:, :inter, :hidden], d.gate_up[:, inter:])  # up
        assert torch.equal(got[:, 128 : 128 + inter, :hidden], d.gate_up[:, :inter])  # gate
        assert torch.equal(gate_up.bias[:, :inter], d.gate_up_bias[:, inter:])
        assert torch.equal(dequantize_stack(down)[:, :hidden, :inter], d.down)
        assert torch.equal(down.bias[:, :hidden], d.down_bias)
        assert torch.equal(k.router, d.router)


def test_gpt_oss_with_kept_experts_through_a_kernel_stand_in(packed, monkeypatch):
    """The whole model on the CPU with its experts kept and run by a stand-in of flashinfer
    0.6.13's W4A16 MoE (its signature, checks and reference semantics): the same logits as
    the dequantized-at-load torch path, and ModelInfo says which path ran."""
    from prefill_worker.batch import BatchPlan, ChunkPlan
    from prefill_worker.model import build
    from prefill_worker.model.moe import flashinfer_mxfp4
    from prefill_worker.request import SamplingParams
    from tests.checkpoints import prompt

    _stand_in_flashinfer(monkeypatch)
    ids, pages = prompt(40, seed=5), [6, 2, 4]
    logits = {}
    for moe in ("grouped", "auto"):
        if moe == "grouped":
            monkeypatch.setattr(
                flashinfer_mxfp4, "mxfp4_experts_choice", lambda *_: ("torch", "asked")
            )
        else:
            monkeypatch.setattr(
                flashinfer_mxfp4, "mxfp4_experts_choice", lambda *_: ("flashinfer", "SI")
            )
        runner, _, info = build(packed, "float32", "cpu", "sdpa", 16, num_pages=8, moe_backend=moe)
        kept = isinstance(runner.model.weights.layers[0].experts, GptOssMxfp4Experts)
        assert kept == (moe == "auto") and info.kernel_paths[0].startswith(
            "experts=flashinfer_mxfp4 (SI)" if kept else "experts=torch (asked)"
        )
        chunk = ChunkPlan("a", ids, 0, 40, pages, SamplingParams())
        logits[moe] = runner.compute_logits(BatchPlan(0, (chunk,)))[0]
    torch.testing.assert_close(logits["auto"], logits["grouped"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        (["model.device=cpu"], "here: dequantized (kept as shipped only on CUDA"),
        (["model.device=cuda", "model.dtype=bfloat16"], "here: kept as shipped on an SM90"),
    ],
)
def test_check_config_states_the_experts_memory(packed, overrides, where):
    """gpt-oss's expert bytes three ways (the tiny one: 3 layers of 5 experts, hidden 96,
    intermediate 64; kept as shipped both padded to 128), and which applies."""
    from prefill_worker.service.checkmodel import check_model
    from prefill_worker.service.config import load_config
    from tests.integration.daemon.conftest import ROOT

    config = load_config(
        ROOT / "configs" / "tiny-test.yaml", env={}, overrides=[f"model.path={packed}", *overrides]
    )
    notes = [n for n in check_model(config).notes if n.startswith("gpt-oss experts (MXFP4)")]
    assert len(notes) == 1 and where in notes[0], notes


def test_the_expert_note_of_gpt_oss_120b(packed):
    """gpt-oss-120b's sizes (36 layers of 128 experts, hidden and intermediate 2880: 2944
    padded): 4.25 bits a parameter shipped, 16 dequantized in bf16, 2944^2 / 2880^2 more kept."""
    import dataclasses

    from prefill_worker.model.hf_config import read_spec
    from prefill_worker.model.hf_sliding import SlidingSpec
    from prefill_worker.model.moe.memory import mxfp4_expert_note

    tiny = read_spec(packed)
    spec = dataclasses.replace(tiny, hidden_size=2880, intermediate_size=2880, num_layers=36)
    sliding = dataclasses.replace(spec.sliding, num_experts=128)
    spec = dataclasses.replace(spec, sliding=sliding)
    assert isinstance(spec.sliding, SlidingSpec)
    params, padded = 36 * 128 * 3 * 2880**2, 36 * 128 * 3 * 2944**2
    biases = 36 * 128 * 3 * 2880 * 2
    shipped = params // 2 + params // 32 + biases
    kept = padded // 2 + padded // 32 + 36 * 128 * 3 * 2944 * 2
    dense = (params + 36 * 128 * 3 * 2880) * 2
    note = mxfp4_expert_note(spec, "bfloat16", 2, may_keep=True)
    assert note == (
        f"gpt-oss experts (MXFP4): {shipped / 2**30:.2f} GiB as shipped; resident "
        f"{dense / 2**30:.2f} GiB dequantized at load in bfloat16, {kept / 2**30:.2f} GiB kept "
        "as shipped (flashinfer's W4A16 MoE, padded to 128); here: kept as shipped on an SM90 "
        "GPU with flashinfer installed, dequantized elsewhere"
    )
    assert 56 < shipped / 2**30 < 57 and 213 < dense / 2**30 < 214  # 120b: ~61 GB of experts


def _stand_in_flashinfer(monkeypatch, **replace: object) -> None:
    """``flashinfer.fused_moe`` as ``flashinfer_stand_ins``' (``replace`` swaps any)."""
    from tests.unit.model import flashinfer_stand_ins

    package = types.ModuleType("flashinfer")
    fused = types.ModuleType("flashinfer.fused_moe")
    for name in ("cutlass_fused_moe", "interleave_moe_weights_for_sm90_mixed_gemm",
                 "interleave_moe_scales_for_sm90_mixed_gemm"):  # fmt: skip
        setattr(fused, name, replace.get(name, getattr(flashinfer_stand_ins, name)))
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused)


def test_the_kernel_is_probed_before_the_experts_are_kept(packed, monkeypatch):
    """A kernel that fails its start-up probe (no compiler for its JIT, say) leaves the
    experts dequantized, and says why; one that runs keeps them."""
    from prefill_worker.model.hf_config import read_spec
    from prefill_worker.model.moe import flashinfer_mxfp4

    def broken(**_: object) -> None:
        raise RuntimeError("nvcc not found")

    sliding = read_spec(packed).sliding
    assert sliding is not None
    monkeypatch.setattr(flashinfer_mxfp4, "mxfp4_experts_choice", lambda *_: ("flashinfer", "SM90"))
    _stand_in_flashinfer(monkeypatch)
    assert flashinfer_mxfp4.mxfp4_experts_line("auto", CPU, BF16, sliding) == (
        "experts=flashinfer_mxfp4 (SM90)"
    )
    _stand_in_flashinfer(monkeypatch, cutlass_fused_moe=broken)
    line = flashinfer_mxfp4.mxfp4_experts_line("auto", CPU, BF16, sliding)
    assert line.startswith("experts=torch (the W4A16 kernel failed its start-up probe") and (
        "nvcc not found" in line
    )
