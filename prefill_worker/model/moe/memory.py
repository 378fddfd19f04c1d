"""``check-config``'s arithmetic for the routed experts under expert parallelism (torch-free):
how many bytes of experts each rank holds at EP N, beside what TP N alone would hold.

    one expert          3 × moe_intermediate_size × hidden parameters (gate, up, down)
    at TP N (EP 1)      every expert's 1/N slice on every rank: E × expert / N per layer
    at EP N             rank r's experts whole: len(local_experts(r)) × expert per layer

Contiguous placement gives every rank E/N experts, the same bytes as TP N; an explicit map
may load one rank more than the others, and the largest rank is what must fit.
"""

from __future__ import annotations

from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.moe.placement import ExpertPlacement

GiB = 2**30


def expert_bytes_per_rank(spec: ModelSpec, placement: ExpertPlacement, itemsize: int) -> list[int]:
    """Each rank's routed-expert bytes (every sparse layer) at ``placement``, in rank order."""
    assert spec.moe is not None
    one = 3 * spec.moe.intermediate_size * spec.hidden_size * itemsize
    num_sparse = len(spec.moe.sparse_layers)
    return [len(placement.local_experts(rank)) * one * num_sparse for rank in range(placement.size)]


def expert_note(
    spec: ModelSpec, placement: ExpertPlacement, dtype: str, itemsize: int, dp: bool = False
) -> str:
    """The line: experts per rank at EP N, the largest rank's bytes, and TP N's for contrast
    (``dp``: over attention-DP ranks, whose other weights are whole on every rank)."""
    assert spec.moe is not None
    per_rank = expert_bytes_per_rank(spec, placement, itemsize)
    size, num_experts = placement.size, spec.moe.num_experts
    tp_bytes = -(-sum(per_rank) // size)
    counts = sorted({len(placement.local_experts(rank)) for rank in range(size)})
    held = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    rest = (
        f"the shared experts, attention and dense layers whole on each of the {size} "
        f"attention-DP ranks (at DP {size} without EP: every expert on every rank, "
        f"{sum(per_rank) / GiB:.2f} GiB)"
        if dp
        else f"(at TP {size} without EP: {tp_bytes / GiB:.2f} GiB, every expert's 1/{size}); "
        f"the shared experts, attention and dense layers split as at TP {size}"
    )
    return (
        f"expert parallel {size}: {held} of {num_experts} routed experts per rank, whole; "
        f"routed experts per rank in {dtype}: up to {max(per_rank) / GiB:.2f} GiB {rest}"
    )


def mxfp4_expert_note(spec: ModelSpec, dtype: str, itemsize: int, may_keep: bool) -> str:
    """gpt-oss's MXFP4 experts (every layer): as shipped, dequantized at load in ``dtype``,
    and kept as shipped (``model.moe.mxfp4``: hidden and intermediate padded to 128, the
    biases in bf16), and which applies: kept where ``may_keep`` (CUDA, bf16, MoE backend
    auto/flashinfer) on an SM90 GPU with flashinfer installed, else dequantized."""
    assert spec.sliding is not None
    experts, inter, hidden = spec.sliding.num_experts, spec.intermediate_size, spec.hidden_size
    num_layers = spec.num_layers

    def stored(n: int, k: int) -> int:  # params at 4 bits, a scale byte per 32, bf16 biases
        params = experts * 3 * n * k
        return num_layers * (params // 2 + params // 32 + experts * (2 * n + k) * 2)

    n_pad, k_pad = -(-inter // 128) * 128, -(-hidden // 128) * 128
    shipped, kept = stored(inter, hidden), stored(n_pad, k_pad)
    dense = num_layers * experts * (3 * inter * hidden + 2 * inter + hidden) * itemsize
    where = (
        "kept as shipped on an SM90 GPU with flashinfer installed, dequantized elsewhere"
        if may_keep
        else "dequantized (kept as shipped only on CUDA in bfloat16, MoE backend auto or "
        "flashinfer, an SM90 GPU with flashinfer)"
    )
    return (
        f"gpt-oss experts (MXFP4): {shipped / GiB:.2f} GiB as shipped; resident "
        f"{dense / GiB:.2f} GiB dequantized at load in {dtype}, {kept / GiB:.2f} GiB kept as "
        f"shipped (flashinfer's W4A16 MoE, padded to 128); here: {where}"
    )
