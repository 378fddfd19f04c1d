"""gpt-oss's MXFP4 experts kept as shipped, for flashinfer's W4A16 MoE (``flashinfer_mxfp4``):
which path a host takes (``mxfp4_experts_choice``), and the packing of the blocks and scales
into the rows and padding that kernel wants, done once at load, on the tensors' device.

As shipped, a stack is ``blocks [E, rows, cols/32, 16]`` uint8 (two FP4 values a byte, low
nibble first) and ``scales [E, rows, cols/32]`` uint8 (a power of two, biased by 127) per 32
values, rows the output features, gate/up rows interleaved (gate even, up odd). The kernel
(``cutlass_fused_moe(use_w4_group_scaling=True)``, SM90's mixed-input grouped GEMM) wants:

    gate_up   [E, 2 N_pad, K_pad / 2]: the up rows, then the gate rows (TensorRT-LLM's w3_w1)
    down      [E, K_pad, N_pad / 2]
    K, N      hidden and intermediate, each padded to a multiple of 128 (each GEMM's
              contraction: 4 groups of 32 per interleaved scale row); the padding is zero
              bytes and zero scale bytes (value 0), zero bias, so padded rows and columns
              add nothing; the input is padded with zero columns and the output cut back

The biases follow their rows (gate_up's into up, gate order). Every step is a row or column
permutation or a zero pad of bytes, so the packed stack dequantizes (``dequantize_stack``) to
exactly the loader's dequantized matrices, reordered and padded: the CPU tests check that.
The kernel's own byte and scale interleave (``interleave_moe_*_for_sm90_mixed_gemm``) runs on
the GPU at start-up (``flashinfer_mxfp4``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MXFP4_BLOCK = 32
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
ALIGN = 128  # each GEMM's contraction: the SM90 kernel's 4 scale groups of 32


@dataclass(frozen=True, slots=True, eq=False)
class Mxfp4Stack:
    """One GEMM's experts as shipped, in the kernel's row order and padding."""

    blocks: torch.Tensor  # [E, rows_pad, cols_pad / 2] uint8
    scales: torch.Tensor  # [E, rows_pad, cols_pad / 32] uint8, biased exponents
    bias: torch.Tensor  # [E, rows_pad], the model's dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.scales, self.bias))


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def mxfp4_experts_choice(
    moe_backend: str,
    device: torch.device,
    dtype: torch.dtype,
    mxfp4: bool,
    capability: tuple[int, int] | None,
    installed: bool,
    tp_size: int = 1,
) -> tuple[str, str]:
    """``(name, why)``: ``flashinfer`` (the experts kept as MXFP4 on the device, run by its
    W4A16 MoE) for an MXFP4 checkpoint with ``moe_backend`` auto or flashinfer on an SM90
    GPU in bf16 with flashinfer installed, at tensor parallel 1; else ``torch`` (dequantized
    at load) and why."""
    if not mxfp4:
        return "torch", "the checkpoint's experts are not MXFP4"
    if moe_backend not in ("auto", "flashinfer") or device.type != "cuda":
        return "torch", f"MoE backend {moe_backend} on {device.type}: dequantized at load"
    if not installed:
        return "torch", "flashinfer is not installed: dequantized at load"
    if tp_size != 1:
        return "torch", f"tensor parallel {tp_size}: dequantized at load (kept at TP 1 only)"
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        return "torch", f"the W4A16 kernel runs in bfloat16, not {name}: dequantized at load"
    if capability != (9, 0):
        sm = "unknown" if capability is None else f"SM{capability[0]}{capability[1]}"
        return "torch", f"flashinfer's MXFP4 W4A16 MoE is SM90's; {sm}: dequantized at load"
    return "flashinfer", "SM90, MXFP4 experts kept as shipped"


def pack_gate_up(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor) -> Mxfp4Stack:
    """The shipped gate_up stack (``[E, 2N, K/32, 16]``, ``[E, 2N, K/32]``, bias ``[E, 2N]``;
    gate/up rows interleaved) as the kernel's: up rows then gate rows, each N padded, K padded."""
    experts, rows, groups = scales.shape
    inter, hidden = rows // 2, groups * MXFP4_BLOCK
    n_pad, k_pad = padded(inter), padded(hidden)
    flat = blocks.reshape(experts, rows, groups * 16)
    out_blocks = flat.new_zeros(experts, 2 * n_pad, k_pad // 2)
    out_scales = scales.new_zeros(experts, 2 * n_pad, k_pad // MXFP4_BLOCK)
    out_bias = bias.new_zeros(experts, 2 * n_pad)
    for half, parity in ((0, 1), (1, 0)):  # the up rows (odd) first, then the gate rows (even)
        rows_to = slice(half * n_pad, half * n_pad + inter)
        out_blocks[:, rows_to, : groups * 16] = flat[:, parity::2]
        out_scales[:, rows_to, :groups] = scales[:, parity::2]
        out_bias[:, rows_to] = bias[:, parity::2]
    return Mxfp4Stack(out_blocks, out_scales, out_bias)


def pack_down(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor) -> Mxfp4Stack:
    """The shipped down stack (``[E, K, N/32, 16]``, ``[E, K, N/32]``, bias ``[E, K]``) with
    K (its rows) and N (its contraction) padded."""
    experts, hidden, groups = scales.shape
    inter = groups * MXFP4_BLOCK
    n_pad, k_pad = padded(inter), padded(hidden)
    out_blocks = blocks.new_zeros(experts, k_pad, n_pad // 2)
    out_scales = scales.new_zeros(experts, k_pad, n_pad // MXFP4_BLOCK)
    out_bias = bias.new_zeros(experts, k_pad)
    out_blocks[:, :hidden, : groups * 16] = blocks.reshape(experts, hidden, groups * 16)
    out_scales[:, :hidden, :groups] = scales
    out_bias[:, :hidden] = bias
    return Mxfp4Stack(out_blocks, out_scales, out_bias)


def dequantize_stack(stack: Mxfp4Stack) -> torch.Tensor:
    """The packed stack as fp32 ``[E, rows_pad, cols_pad]`` (the loader's dequantizer)."""
    experts, rows, groups = stack.scales.shape
    blocks = stack.blocks.reshape(experts, rows, groups, 16)
    return dequantize_mxfp4(blocks, stack.scales.to(torch.int32) - 127)


def dequantize_mxfp4(blocks: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``exponents [..., G]`` (unbiased) -> ``[..., G 32]``
    fp32: value ``2 i`` is the low nibble of byte ``i``, ``2 i + 1`` its high nibble."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2)
