"""A block-scaled FP8 GEMM on CUDA: ``y = x @ Wᵀ`` with ``W`` kept as shipped (float8_e4m3fn
``[N, K]`` and its ``weight_scale_inv`` ``[ceil(N / 128), ceil(K / 128)]``) and ``x``
quantized per token in groups of 128 columns (DeepSeek-V3's recipe, SGLang's and vLLM's
``w8a8_block_fp8_matmul``)::

    x [M, K] bf16 --act_quant--> x8 [M, K] e4m3, sx [M, ceil(K/128)] f32  (amax / 448 each)
    y[m, n] = sum over k-blocks b of  sx[m, b] · sw[n // 128, b] · (x8[m, b] · W8[n, b])

The kernel is torch's ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128``
for ``x`` and ``BlockWise128x128`` for ``W`` (Hopper, CUDA 12.9+ cuBLASLt: ``find_kernel``
says whether this torch has it). Its scale layouts (``scale_layouts``): both scales
outer-dimension-major (column-major), their leading dimension padded to a multiple of 4
(16 bytes of float32), as cuBLASLt's blockwise scaling wants them::

    sx  [M, K/128]    strides (1, M4)     M4 = M rounded up to 4
    sw  [K/128, N/128] strides (1, K4)    (W's scale_inv transposed; K4 = K/128 rounded to 4)

``W8`` goes in as ``W8.t()`` (``[K, N]``, column-major: no copy). ``reference_linear`` is the
same arithmetic in float32 on any device: what the kernel is checked against (gpu-marked
tests) and what CPU unit tests check the quantization and the layouts with.

The model's linear layers run it through ``quant.linear.linear``: the loader's ``block_gemm``
backend (``quant.backends``, chosen on a Hopper GPU) keeps each FP8 weight as an
``Fp8BlockWeight`` carrying its ``kernel`` (this module's ``block_fp8_linear``; a test puts a
CPU stand-in there). Stacked MoE experts are one ``Fp8BlockWeight`` with a leading expert
dimension, indexed per expert. FlashInfer's groupwise FP8 GEMM is not used (its scale-layout
contract differs between releases); where torch lacks the blockwise kernel, the loader
dequantizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP = 128  # columns of x per activation scale; W's block is GROUP × GROUP
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_MIN_AMAX = 1e-12  # an all-zero group gets a tiny scale, not a division by zero


Kernel = Callable[[torch.Tensor, "Fp8BlockWeight"], torch.Tensor]
"""``kernel(x [M, K], w)`` -> ``x @ Wᵀ`` ``[M, N]`` in ``x``'s dtype."""


@dataclass(frozen=True, slots=True, eq=False)
class Fp8BlockWeight:
    """A linear layer's weight as shipped: ``weight [..., N, K]`` float8_e4m3fn and
    ``scale_inv [..., ceil(N/128), ceil(K/128)]`` float32 (the factor that multiplies it back),
    a leading dimension for stacked experts; ``kernel`` multiplies by it (None: the CUDA
    kernel, ``block_fp8_linear``)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    kernel: Kernel | None = None

    def __post_init__(self) -> None:
        *lead, rows, columns = self.weight.shape
        want = (*lead, -(-rows // GROUP), -(-columns // GROUP))
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(
                f"a {list(self.weight.shape)} FP8 weight needs scales of {list(want)}, "
                f"got {list(self.scale_inv.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, expert: int) -> Fp8BlockWeight:
        """One expert's weight of a stack."""
        return Fp8BlockWeight(self.weight[expert], self.scale_inv[expert], self.kernel)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``x @ Wᵀ`` ``[M, N]`` in ``x``'s dtype, on ``kernel``."""
        if self.kernel is None:
            return block_fp8_linear(x, self, x.dtype)
        return self.kernel(x, self)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W`` = FP8 × the scale of each element's block, in ``dtype`` (one matrix)."""
        rows, columns = self.weight.shape
        factors = self.scale_inv.float().repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
        return (self.weight.float() * factors[:rows, :columns]).to(dtype)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``x8 [M, K]`` e4m3, ``sx [M, ceil(K/128)]`` float32) with
    ``x ≈ x8 · sx`` per 128-column group: each group's amax maps to ±448."""
    rows, columns = x.shape
    num_groups = -(-columns // GROUP)
    padded = torch.zeros(rows, num_groups * GROUP, dtype=torch.float32, device=x.device)
    padded[:, :columns] = x.float()
    groups = padded.view(rows, num_groups, GROUP)
    scales = groups.abs().amax(dim=-1).clamp(min=_MIN_AMAX) / FP8_MAX  # [M, groups]
    quantized = (groups / scales[..., None]).to(torch.float8_e4m3fn)
    return quantized.view(rows, -1)[:, :columns], scales


def scale_layouts(sx: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``scale_a`` and ``scale_b``: ``sx [M, K/128]`` column-major (strides
    ``(1, M)``), and ``W``'s ``scale_inv [N/128, K/128]`` transposed to ``[K4, N/128]``,
    column-major (strides ``(1, K4)``), its rows past ``K/128`` zero (never read)."""
    num_blocks, k_blocks = scale_inv.shape
    lead = -(-k_blocks // 4) * 4  # K4
    padded = torch.zeros(num_blocks, lead, dtype=torch.float32, device=scale_inv.device)
    padded[:, :k_blocks] = scale_inv
    return sx.t().contiguous().t(), padded.t()


def reference_linear(x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """The kernel's arithmetic in float32: ``x`` quantized as the kernel's caller does, times
    the dequantized weight. ``[M, N]`` float32."""
    x8, sx = act_quant(x)
    columns = x.shape[1]
    x_values = x8.float() * sx.repeat_interleave(GROUP, dim=1)[:, :columns]
    return x_values @ w.dequantized().t()


def find_kernel() -> str | None:
    """Why this torch cannot run the blockwise kernel here, None when it can: a CUDA device
    of compute capability 9.x (Hopper) and torch's ``scaled_mm`` with blockwise scaling."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    if scaling is None or not hasattr(scaling, "BlockWise128x128"):
        return f"torch {torch.__version__} has no blockwise scaled_mm"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return f"cuBLASLt's blockwise FP8 scaling runs on compute capability 9.x, not {major}.x"
    return None


def block_fp8_linear(
    x: torch.Tensor, w: Fp8BlockWeight, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``x [M, K]`` (CUDA) times ``w``ᵀ -> ``[M, N]`` in ``out_dtype``, on torch's blockwise
    kernel (``find_kernel`` None; N and K multiples of 128, else ``ValueError``)."""
    rows, columns = w.weight.shape
    if rows % GROUP or columns % GROUP:
        raise ValueError(f"a [{rows}, {columns}] weight: the blockwise kernel needs whole blocks")
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    x8, sx = act_quant(x)
    scale_a, scale_b = scale_layouts(sx, w.scale_inv)
    return scaled_mm(
        x8,
        w.weight.t(),
        scale_a,
        ScalingType.BlockWise1x128,
        scale_b,
        ScalingType.BlockWise128x128,
        swizzle_a=SwizzleType.NO_SWIZZLE,
        swizzle_b=SwizzleType.NO_SWIZZLE,
        output_dtype=out_dtype,
    )
