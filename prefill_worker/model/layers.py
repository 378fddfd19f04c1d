"""Stateless building blocks of the decoder: RMSNorm, rotary embedding, SwiGLU.

Every function works on packed tokens (``[T, ...]``, no batch dimension, no padding) and
matches ``transformers``' arithmetic order in fp32, so logits agree to ~1e-6.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from prefill_worker.model.hf_config import RopeSpec, yarn_mscale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: the mean square in fp32, the scaling in x's dtype.

    Three passes over ``x`` (a reduction and two products) instead of the five of the
    composite ``F.rms_norm``: elementwise work is memory-bound on a CPU. In fp32 this is
    HF's arithmetic; in bf16/fp16 the factor is rounded before the product (HF rounds
    after it), a difference within one rounding of the result."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [..., 1]
    inv_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps)).to(x.dtype)
    return (x * inv_rms).mul_(weight)


def silu_and_mul_(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I] -> [T, I]`` view: silu(gate) * up, computed in place in the gate half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies, with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        return _llama3_scaled(inv_freq, spec)
    if spec.rope_type == "yarn":
        return _yarn_scaled(inv_freq, spec, head_dim)
    return inv_freq


def rope_attention_factor(spec: RopeSpec) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other types)."""
    if spec.rope_type != "yarn":
        return 1.0
    if spec.attention_factor is not None:
        return spec.attention_factor
    if spec.mscale and spec.mscale_all_dim:
        return yarn_mscale(spec.factor, spec.mscale) / yarn_mscale(spec.factor, spec.mscale_all_dim)
    return yarn_mscale(spec.factor)


def _yarn_scaled(inv_freq: torch.Tensor, spec: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN: the fast dimensions kept (extrapolated), the slow ones divided by ``factor``
    (interpolated), a linear ramp between the ``beta_fast`` / ``beta_slow`` rotation bounds."""

    def correction_dim(rotations: float) -> float:
        turns = spec.original_max_position / (rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolation = 1.0 / (spec.factor * (1.0 / inv_freq))  # transformers' rounding
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


def _llama3_scaled(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """Rotary position embedding in the half-split (GPT-NeoX / HF Llama) convention."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(spec, head_dim).to(device)  # [D/2] fp32
        self.attention_factor = rope_attention_factor(spec)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> cos, sin ``[T, 1, D/2]`` in ``dtype`` (computed in fp32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # YaRN scales both, in fp32 (as transformers)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def apply_into(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out [T, heads, D]`` = ``x`` rotated: HF's ``x * cos + rotate_half(x) * sin``."""
        x1, x2 = x.chunk(2, dim=-1)
        out1, out2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=out1)
        out1.addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=out2)
        out2.addcmul_(x1, sin)

    @staticmethod
    def apply_interleaved_into(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out [T, heads, D]`` = ``x`` rotated in interleaved pairs (x0, x1), (x2, x3)...
        (DeepSeek's ``rope_interleave``), each pair written back in place (GPT-J style):
        the values of transformers' rotation, in SGLang's order (transformers writes the
        rotated even elements first, then the odd ones)."""
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out1, out2 = out[..., 0::2], out[..., 1::2]
        out1.copy_(x1 * cos - x2 * sin)
        out2.copy_(x2 * cos + x1 * sin)
