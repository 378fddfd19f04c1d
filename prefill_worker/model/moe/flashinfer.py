"""The CUDA MoE backend: flashinfer's fused CUTLASS MoE (``flashinfer.fused_moe``).

One kernel call per layer does the permutation by expert, both grouped GEMMs, the SwiGLU and
the weighted un-permutation. Its first GEMM's weight is ``[E, 2I, hidden]`` with the *up*
rows first (TensorRT-LLM's ``w3_w1`` order), so ``prepare`` reorders the loader's
gate-first stack once, at start-up; the down stack ``[E, hidden, I]`` is used as it is.
bf16/fp16 weights only (the kernel has no fp32 path); tested on a GPU only
(``tests/gpu/test_moe_cuda.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from prefill_worker.model.moe.base import MoEWeights
from prefill_worker.model.quant.linear import Weight


class FlashInferExperts:
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        from flashinfer.fused_moe import cutlass_fused_moe  # CUDA only: imported when chosen

        self.device = device
        self._fused_moe = cutlass_fused_moe

    def prepare(self, weights: MoEWeights) -> MoEWeights:
        """The stacks in the kernel's order: ``[up | gate]`` rows per expert. Experts kept in
        FP8 (``quant.linear``) are the grouped backend's: ``build`` never pairs them with this."""
        if not isinstance(weights.gate_up, torch.Tensor):
            raise ValueError("the flashinfer MoE backend takes bf16/fp16 experts, not FP8 blocks")
        gate, up = weights.gate_up.chunk(2, dim=1)
        return dataclasses.replace(weights, gate_up=torch.cat([up, gate], dim=1).contiguous())

    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_up: Weight,  # [E, 2I, hidden], prepared: up rows first
        down: Weight,
    ) -> torch.Tensor:
        out = self._fused_moe(
            input=x.contiguous(),
            token_selected_experts=ids.to(torch.int32),
            token_final_scales=weights.float(),
            fc1_expert_weights=gate_up,
            fc2_expert_weights=down,
            output_dtype=x.dtype,
            quant_scales=[],
        )
        return out[0] if isinstance(out, (list, tuple)) else out
