"""A tiny DeepSeek-V3 FP8 checkpoint in 128 × 128 blocks, and its forward through ``build``
with a chosen FP8 backend: what the block-GEMM wiring tests (CPU:
tests/integration/model/test_fp8_block_gemm.py; CUDA: tests/gpu/test_fp8_model_cuda.py) share.

DeepSeek-V3's structure at 128-block sizes: hidden 256, 4 heads of nope 64 + rope 64 (q_b 512
rows), v 64 (o 256 columns: 128 a rank at TP 2), q_lora and kv_lora 128 (kv_a 192 rows: not
whole blocks, as DeepSeek-V3's 576), a dense layer and a MoE layer of 8 experts of 256 and
one shared expert.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.quant.backends import Fp8WeightBackend
from prefill_worker.model.quant.block_gemm import Fp8BlockWeight, Kernel, reference_linear
from prefill_worker.request import SamplingParams
from tests.fp8_checkpoints import make_fp8_checkpoint

SHAPE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, q_lora_rank=128,
             kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, qk_head_dim=128,
             head_dim=64, v_head_dim=64, num_hidden_layers=2, n_routed_experts=8,
             num_experts_per_tok=2, first_k_dense_replace=1)  # fmt: skip
NUM_KEPT = 3 * 2 + 2 + 2 + 2 * 8  # q_a/q_b/o × 2 layers, the dense MLP, the shared, 8 experts
# Qwen2 (the Llama family, with q/k/v biases): 4 heads of 64 over 2 KV heads (q/k/v 256 + 128 +
# 128 rows, fused), an MLP of 256; every projection whole blocks.
LLAMA_SHAPE = dict(hidden_size=256, intermediate_size=256)
PAGE_SIZE, NUM_PAGES = 16, 16


def make_checkpoint(root: Path, family: str = "deepseek_v3") -> Path:
    shape = SHAPE if family == "deepseek_v3" else LLAMA_SHAPE
    return make_fp8_checkpoint(family, root, block=(128, 128), **shape)[0]


class Recorder:
    """A kernel wrapper: checks each call's layouts, records its weight (data pointer) and its
    distance (norm) from the dequantized linear on the same input; returns ``kernel``'s
    output (None: the dequantized linear itself, exact; ``reference``: the kernel's float32
    arithmetic, ``block_gemm.reference_linear``)."""

    def __init__(self, kernel: Kernel | str | None = None) -> None:
        self.kernel = kernel
        self.calls: list[int] = []
        self.errors: list[float] = []

    def __call__(self, x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
        assert x.ndim == 2 and x.shape[1] == w.shape[1] and w.weight.ndim == 2
        assert w.weight.dtype == torch.float8_e4m3fn and w.scale_inv.dtype == torch.float32
        assert w.scale_inv.shape == (w.shape[0] // 128, w.shape[1] // 128)
        assert x.device == w.weight.device == w.scale_inv.device
        self.calls.append(w.weight.data_ptr())
        exact = F.linear(x.float(), w.dequantized()).to(x.dtype)
        if self.kernel is None:
            return exact
        if self.kernel == "reference":
            got = reference_linear(x, w).to(x.dtype)
        else:
            assert callable(self.kernel)
            got = self.kernel(x, w)
        self.errors.append(((got.float() - exact.float()).norm() / exact.float().norm()).item())
        return got


def forward(
    path: Path, fp8: Fp8WeightBackend, ids: list[int], dtype: str = "float32",
    device: str = "cpu",
) -> tuple[torch.Tensor, list[torch.Tensor], Any]:  # fmt: skip
    """(last logits, each layer's latent rows, the model's weights) of ``ids`` (naive MoE:
    every expert runs on every token, so every expert's GEMMs are called)."""
    runner, kv_cache, _ = build(path, dtype=dtype, device=device, page_size=PAGE_SIZE,
                                num_pages=NUM_PAGES, moe_backend="naive",
                                fp8_backend=fp8)  # fmt: skip
    pages = list(range(-(-len(ids) // PAGE_SIZE)))
    chunk = ChunkPlan("a", ids, 0, len(ids), pages, SamplingParams())
    batch = BatchPlan(batch_id=0, chunks=(dataclasses.replace(chunk, state_slot=0),))
    logits = runner.compute_logits(batch)[0].float().cpu()
    rows = [  # an MLA pool's latent rows, or the first KV head's keys
        torch.cat([kv_cache.k[layer][p] for p in pages])[: len(ids), 0].float().cpu()
        for layer in range(len(kv_cache.k))
    ]
    return logits, rows, runner.model.weights  # type: ignore[attr-defined]
