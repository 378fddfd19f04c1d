"""The block-scaled FP8 GEMM path wired into the model, on a CPU: a tiny DeepSeek-V3 FP8
checkpoint in 128 × 128 blocks (``tests/fp8_gemm_model.py``: every projection whole blocks but
``kv_a_proj_with_mqa``, 192 rows, as DeepSeek-V3's 576) loaded with the registry's CUDA choice
(``block_gemm``) forced, its kernel swapped for a CPU stand-in (a unit seam: the kernel itself
is tests/gpu/test_block_gemm_cuda.py's, the model on CUDA tests/gpu/test_fp8_model_cuda.py's).

* every FP8 projection the GEMM takes (q_a, q_b, o, the dense MLP, every expert's gate/up and
  down, the shared expert) is held as shipped (e4m3, its own block scales) and every one runs
  through the kernel with ``[M, K]`` activations and ``[N/128, K/128]`` scales; kv_b (the
  attention backends take it dense) and kv_a (not whole blocks) are dequantized;
* with a stand-in that multiplies by the dequantized weight, logits and latent rows equal the
  dequantizing path's (1e-5, float32); with the kernel's arithmetic (activations quantized
  per token in groups of 128, ``reference_linear``) each call is within FP8's error (< 4%)
  of the dequantized linear;
* the Llama family (Qwen2: fused q/k/v with biases, the fused gate/up written into its
  buffer) likewise: every projection kept and called, logits and K equal the dequantized
  (the bias is added after the GEMM: K within 1e-4);
* at TP 2 each rank's kept blocks and scales are its slice of the shipped ones (dequantized:
  the dequantizing rank's weight exactly); at TP 4 o's 128 columns cut a block: refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from prefill_worker.model.deepseek import MLAModelWeights
from prefill_worker.model.hf_config import CheckpointError, read_spec
from prefill_worker.model.llama import DenseMLP
from prefill_worker.model.loader import load_checkpoint
from prefill_worker.model.moe import resolve_moe_backend_name
from prefill_worker.model.moe.base import MoEWeights
from prefill_worker.model.parallel import TPGroup
from prefill_worker.model.quant.backends import (
    BlockGemm,
    create_fp8_backend,
    select_fp8_backend,
)
from prefill_worker.model.quant.block_gemm import Fp8BlockWeight
from tests.checkpoints import prompt
from tests.fp8_gemm_model import NUM_KEPT, Recorder, forward, make_checkpoint

IDS = prompt(40, seed=5)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("fp8_gemm"))


def kept_weights(weights: MLAModelWeights) -> dict[str, Fp8BlockWeight]:
    """Every weight the GEMM path must hold in FP8, by name; asserts the dense ones are."""
    out: dict[str, Fp8BlockWeight] = {}
    for index, layer in enumerate(weights.layers):
        attn, mlp = layer.attn, layer.mlp
        assert isinstance(attn.kv_b, torch.Tensor) and isinstance(attn.kv_a, torch.Tensor)
        out |= {f"{index}.q_a": attn.q_a, f"{index}.q_b": attn.q_b, f"{index}.o": attn.o}  # type: ignore[dict-item]
        if isinstance(mlp, DenseMLP):
            out |= {f"{index}.gate_up": mlp.gate_up, f"{index}.down": mlp.down}  # type: ignore[dict-item]
            continue
        assert isinstance(mlp, MoEWeights) and isinstance(mlp.router, torch.Tensor)
        out[f"{index}.shared_gate_up"] = mlp.shared_gate_up  # type: ignore[assignment]
        out[f"{index}.shared_down"] = mlp.shared_down  # type: ignore[assignment]
        for e in range(mlp.gate_up.shape[0]):
            out |= {f"{index}.{e}.gate_up": mlp.gate_up[e], f"{index}.{e}.down": mlp.down[e]}  # type: ignore[index]
    assert all(isinstance(w, Fp8BlockWeight) for w in out.values()), out
    return out


def test_every_fp8_projection_runs_the_gemm_and_equals_the_dequantized_model(checkpoint):
    want_logits, want_rows, _ = forward(checkpoint, create_fp8_backend("dequantize"), IDS)
    recorder = Recorder()
    logits, rows, weights = forward(checkpoint, BlockGemm(recorder), IDS)
    kept = kept_weights(weights)
    assert len(kept) == NUM_KEPT
    assert {w.weight.data_ptr() for w in kept.values()} <= set(recorder.calls)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    for got, want in zip(rows, want_rows, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_llama_family_model_runs_the_gemm_too(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2")
    want_logits, want_keys, _ = forward(path, create_fp8_backend("dequantize"), IDS)
    recorder = Recorder()
    logits, keys, weights = forward(path, BlockGemm(recorder), IDS)
    kept = [w for layer in weights.layers
            for w in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]  # fmt: skip
    assert all(isinstance(w, Fp8BlockWeight) for w in kept) and len(kept) == 8
    assert {w.weight.data_ptr() for w in kept} == set(recorder.calls)
    assert all(layer.qkv_bias.dtype == torch.float32 for layer in weights.layers)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    for got, want in zip(keys, want_keys, strict=True):  # keys of ~100: the bias added apart
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_each_call_is_within_fp8_error_of_the_dequantized_linear(checkpoint):
    """The kernel's arithmetic (e4m3 activations, 1 × 128 scales) in every call of a forward:
    about 2.5% from the dequantized linear in norm (e4m3 keeps 3 mantissa bits). The whole
    model's logits are not compared: tokens through a random model whose attention scores
    are scaled up (tests/checkpoints.py) amplify that error past any useful bound."""
    recorder = Recorder("reference")
    logits, _, _ = forward(checkpoint, BlockGemm(recorder), IDS[:16])
    assert len(recorder.errors) >= NUM_KEPT and torch.isfinite(logits).all()
    assert min(recorder.errors) > 0.005 and max(recorder.errors) < 0.04, recorder.errors


def test_tp2_ranks_keep_their_blocks_and_scales(checkpoint):
    for rank in range(2):
        tp = TPGroup(rank, 2)
        gemm = BlockGemm(Recorder())
        _, kept = load_checkpoint(checkpoint, torch.float32, CPU, tp=tp, fp8=gemm)
        _, plain = load_checkpoint(checkpoint, torch.float32, CPU, tp=tp)
        assert isinstance(kept, MLAModelWeights) and isinstance(plain, MLAModelWeights)
        ours = kept_weights(kept)
        assert ours["0.q_b"].shape == (256, 128) and ours["0.o"].shape == (256, 128)
        assert ours["1.0.gate_up"].shape == (256, 256) and ours["1.0.down"].shape == (256, 128)
        for name, weight in ours.items():
            layer, rest = int(name[0]), name[2:]
            dense = _dense_of(plain.layers[layer], rest)
            assert torch.equal(weight.dequantized(), dense), (rank, name)


def _dense_of(layer, name: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if name in ("q_a", "q_b", "o"):
        return getattr(layer.attn, name)
    if name.startswith("shared_"):
        return getattr(layer.mlp, name)
    if "." in name:
        expert, which = name.split(".")
        return getattr(layer.mlp, which)[int(expert)]
    return getattr(layer.mlp, name)


def test_a_cut_inside_a_block_is_refused_with_the_reason(checkpoint):
    with pytest.raises(CheckpointError, match=r"cut a 128-wide scale block.*whole blocks"):
        load_checkpoint(checkpoint, torch.float32, CPU, tp=TPGroup(0, 4), fp8=BlockGemm())
    load_checkpoint(checkpoint, torch.float32, CPU, tp=TPGroup(0, 4))  # dequantized: served


def test_the_registry_keeps_fp8_on_a_hopper_gpu_only(checkpoint):
    spec, cuda = read_spec(checkpoint), torch.device("cuda")
    assert select_fp8_backend(spec, CPU) == "dequantize"
    assert select_fp8_backend(spec, cuda, lambda: None) == "block_gemm"
    assert select_fp8_backend(spec, cuda, lambda: "compute capability 8.x") == "dequantize"
    channel = dataclasses.replace(spec, quant=dataclasses.replace(spec.quant, block=(64, 64)))  # type: ignore[type-var]
    assert select_fp8_backend(channel, cuda, lambda: None) == "dequantize"
    assert resolve_moe_backend_name("auto", cuda, torch.bfloat16, fp8_experts=True) == "grouped"
    with pytest.raises(ValueError, match="kept in FP8"):
        resolve_moe_backend_name("flashinfer", cuda, torch.bfloat16, fp8_experts=True)
