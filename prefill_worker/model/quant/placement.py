"""Which FP8 weights the block-scaled GEMM keeps as shipped, and which it dequantizes at load
anyway: one rule for the loader (``quant.backends``) and ``check-config``'s arithmetic
(``quant.memory``). Torch-free.

The GEMM (``quant.block_gemm``) works on whole 128 × 128 blocks, so it keeps a weight in FP8
when the checkpoint's blocks are 128 × 128 and this rank's slice of it is whole blocks both
ways; every other FP8 weight is dequantized to the model's dtype at load:

    kv_b_proj (MLA)          the attention backends take it dense (decompression and, on
                             flashinfer, its absorbed per-head halves), as SGLang's does
    a DSA indexer's weights  its scoring casts them (``weights_proj`` to float32)
    not whole blocks         e.g. DeepSeek-V3's kv_a_proj_with_mqa, 576 rows (4.5 blocks)

A tensor-parallel cut inside a block is refused for a kept weight (``misaligned_cut``, the
loader's check before any tensor is read): no rank could run whole blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prefill_worker.model.hf_config import CheckpointError
from prefill_worker.model.quant.spec import BLOCK, QuantSpec

GEMM_BLOCK = (128, 128)  # the kernel's: 1 × 128 activation groups, 128 × 128 weight blocks
DENSE_USES = ("kv_b_proj.", ".indexer.")  # names whose consumer needs a dense matrix


def gemm_block(quant: QuantSpec | None) -> bool:
    """Whether the checkpoint's FP8 is what the kernel takes (block scales of 128 × 128)."""
    return quant is not None and quant.strategy == BLOCK and quant.block == GEMM_BLOCK


def dense_use(name: str) -> bool:
    """Whether ``name``'s consumer takes a dense matrix only (dequantized whatever its shape)."""
    return any(use in name for use in DENSE_USES)


def kept_in_fp8(name: str, local_shape: tuple[int, ...]) -> bool:
    """Whether the GEMM keeps FP8 ``name`` (``local_shape``: this rank's slice) as shipped."""
    if dense_use(name) or len(local_shape) != 2:
        return False
    return all(size % unit == 0 for size, unit in zip(local_shape, GEMM_BLOCK, strict=True))


def misaligned_cut(quant: QuantSpec, name: str, dim: int, cut: slice, length: int) -> str | None:
    """Why rank's ``cut`` of dimension ``dim`` (of ``length``) of ``name`` splits a scale
    block, or None when it starts and ends on block boundaries (or the tensor's end)."""
    if quant.strategy != BLOCK or quant.block is None:
        return None
    unit = quant.block[dim]
    start, stop = cut.start or 0, length if cut.stop is None else cut.stop
    if start % unit == 0 and (stop % unit == 0 or stop == length):
        return None
    return (
        f"tensor {name}: this rank's {'rows' if dim == 0 else 'columns'} [{start}, {stop}) cut "
        f"a {unit}-wide scale block; the block-scaled FP8 GEMM needs whole blocks per rank "
        f"(a tensor-parallel size that cuts on block boundaries serves it; on a CPU, or where "
        f"the GEMM is not selected, the weights are dequantized and every cut is served)"
    )


def check_cuts(
    quant: QuantSpec,
    shapes: Mapping[str, tuple[int, ...]],
    is_fp8: Callable[[str], bool],
    cut_of: Callable[[str], tuple[int | None, slice]],
) -> None:
    """Refuse (``CheckpointError``, the reason) the first FP8 tensor of ``shapes`` the GEMM
    would keep whose rank slice (``cut_of(name)``: the dimension cut, None for a replicated
    one, and where) splits a scale block. The loader calls it before reading any tensor."""
    for name, shape in shapes.items():
        if len(shape) != 2 or dense_use(name) or not is_fp8(name):
            continue
        dim, cut = cut_of(name)
        reason = None if dim is None else misaligned_cut(quant, name, dim, cut, shape[dim])
        if reason is not None:
            raise CheckpointError(reason)
