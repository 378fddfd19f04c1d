"""gpt-oss's experts on flashinfer 0.6.13's W4A16 MoE: ``cutlass_fused_moe`` with
``use_w4_group_scaling=True`` (SM90's mixed-input grouped GEMM: bf16 activations, MXFP4
weights), the clamped SwiGLU in the kernel (per expert ``alpha``, ``beta`` = 1 for the
``up + 1``, ``limit``), both biases. One call per layer over the routed (token, expert) pairs.

``mxfp4_experts_line`` decides, before the weights load, whether they stay as shipped:
``mxfp4.mxfp4_experts_choice``, then a start-up probe of the kernel (one tiny layer: the
import, a JIT build, a launch), a failure leaving the dequantized path with the reason.
``prepare`` takes the packed stacks (``mxfp4.pack_*``: the kernel's rows and padding) and
applies the kernel's byte and scale interleave once, on the GPU. The routing stays the
model's (top-k of the router's logits, softmax over the k). CUDA only: imported when chosen
(``gpt_oss.GptOssLM``), proven on a GPU by ``tests/gpu/test_mxfp4_cuda.py``.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefill_worker.model.hf_sliding import SlidingSpec
from prefill_worker.model.moe.mxfp4 import (
    MXFP4_BLOCK,
    Mxfp4Stack,
    mxfp4_experts_choice,
    pack_down,
    pack_gate_up,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class PreparedMxfp4:
    gate_up: torch.Tensor  # [E, 2 N_pad, K_pad / 2] uint8, interleaved for the kernel
    down: torch.Tensor  # [E, K_pad, N_pad / 2] uint8
    scales: list[torch.Tensor]  # gate_up's then down's, interleaved, viewed as int32
    gate_up_bias: torch.Tensor  # [E, 2 N_pad]
    down_bias: torch.Tensor  # [E, K_pad]
    alpha: torch.Tensor  # [E] fp32
    beta: torch.Tensor  # [E] fp32
    limit: torch.Tensor  # [E] fp32


class FlashInferMxfp4Experts:
    name = "flashinfer_mxfp4"

    def __init__(self, swiglu_alpha: float, swiglu_limit: float) -> None:
        from flashinfer.fused_moe import (  # CUDA only: imported when chosen
            cutlass_fused_moe,
            interleave_moe_scales_for_sm90_mixed_gemm,
            interleave_moe_weights_for_sm90_mixed_gemm,
        )

        self._fused_moe = cutlass_fused_moe
        self._weights = interleave_moe_weights_for_sm90_mixed_gemm
        self._scales = interleave_moe_scales_for_sm90_mixed_gemm
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit

    def prepare(self, gate_up: Mxfp4Stack, down: Mxfp4Stack) -> PreparedMxfp4:
        experts, device = gate_up.blocks.shape[0], gate_up.blocks.device

        def full(value: float) -> torch.Tensor:
            return torch.full((experts,), value, dtype=torch.float32, device=device)

        scales = [
            self._scales(s.contiguous(), group_size=MXFP4_BLOCK).view(torch.int32)
            for s in (gate_up.scales, down.scales)
        ]
        return PreparedMxfp4(
            gate_up=self._weights(gate_up.blocks.contiguous(), "fp4"),
            down=self._weights(down.blocks.contiguous(), "fp4"),
            scales=scales,
            gate_up_bias=gate_up.bias.contiguous(),
            down_bias=down.bias.contiguous(),
            alpha=full(self.swiglu_alpha),
            beta=full(1.0),
            limit=full(self.swiglu_limit),
        )

    def __call__(
        self,
        h: torch.Tensor,  # [T, hidden] bf16
        weights: torch.Tensor,  # [T, k]
        ids: torch.Tensor,  # [T, k]
        w: PreparedMxfp4,
    ) -> torch.Tensor:
        hidden, k_pad = h.shape[1], w.down.shape[1]
        x = F.pad(h, (0, k_pad - hidden)).contiguous()
        out = torch.empty_like(x)
        self._fused_moe(
            input=x,
            token_selected_experts=ids.to(torch.int32).contiguous(),
            token_final_scales=weights.float().contiguous(),
            fc1_expert_weights=w.gate_up,
            fc2_expert_weights=w.down,
            output_dtype=h.dtype,
            quant_scales=w.scales,
            fc1_expert_biases=w.gate_up_bias,
            fc2_expert_biases=w.down_bias,
            swiglu_alpha=w.alpha,
            swiglu_beta=w.beta,
            swiglu_limit=w.limit,
            use_w4_group_scaling=True,
            output=out,
        )
        return out[:, :hidden]


def mxfp4_experts_line(
    moe_backend: str,
    device: torch.device,
    dtype: torch.dtype,
    sliding: SlidingSpec,
    tp_size: int = 1,
) -> str:
    """gpt-oss's experts path on this host, as a line: ``experts=flashinfer_mxfp4 (why)`` or
    ``experts=torch (why)`` (``ModelInfo.kernel_paths``); logged."""
    cuda = device.type == "cuda"
    name, why = mxfp4_experts_choice(
        moe_backend,
        device,
        dtype,
        sliding.mxfp4,
        torch.cuda.get_device_capability(device) if cuda else None,
        cuda and importlib.util.find_spec("flashinfer") is not None,
        tp_size,
    )
    if name == "flashinfer":
        failure = probe(device, sliding)
        name, why = ("flashinfer_mxfp4", why) if failure is None else ("torch", failure)
    if cuda and sliding.mxfp4 and name == "torch":
        log.warning("gpt-oss experts: dequantized at load on CUDA: %s", why)
    else:
        log.info("gpt-oss experts: %s (%s)", name, why)
    return f"experts={name} ({why})"


def probe(device: torch.device, sliding: SlidingSpec) -> str | None:
    """None once the kernel ran one tiny layer (2 experts, hidden and intermediate 128) to
    finite values; else why not."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)

        def shipped(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            blocks = torch.randint(0, 256, (2, rows, 4, 16), generator=gen, device=device)
            scales = torch.randint(118, 123, (2, rows, 4), generator=gen, device=device)
            bias = torch.zeros(2, rows, device=device, dtype=torch.bfloat16)
            return blocks.to(torch.uint8), scales.to(torch.uint8), bias

        kernel = FlashInferMxfp4Experts(sliding.swiglu_alpha, sliding.swiglu_limit)
        w = kernel.prepare(pack_gate_up(*shipped(256)), pack_down(*shipped(128)))
        h = torch.randn(3, 128, generator=gen, device=device).to(torch.bfloat16)
        ids = torch.tensor([[0, 1]] * 3, device=device)
        out = kernel(h, torch.full((3, 2), 0.5, device=device), ids, w)
        if not bool(out.float().isfinite().all()):
            return "the W4A16 kernel gave non-finite values in its start-up probe"
    except Exception as exc:
        return f"the W4A16 kernel failed its start-up probe: {exc!r}: dequantized at load"[:300]
    return None
