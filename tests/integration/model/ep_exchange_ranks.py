"""The all-to-all exchange as attention-DP ranks will call it, run on every rank of
``test_expert_parallel``'s world (4 gloo CPU processes) after its cases: each rank brings its
own number of tokens (5, 0, 3 and 2), under an uneven explicit placement (3, 2, 1 and 2
experts), and saves what it gets back for each token's routed experts' weighted sum, and what one
process holding every expert computes it; in fp32, in bf16 (the slots packed in bf16), and
in bf16 with 297 experts on one rank (local ids past bf16's exact 256: packed in fp32)."""

from __future__ import annotations

from pathlib import Path

import torch

from prefill_worker.model.moe import create_moe_backend
from prefill_worker.model.moe.alltoall import TorchAllToAll
from prefill_worker.model.moe.placement import ExpertPlacement

PLACEMENT = ExpertPlacement((2, 0, 0, 1, 3, 3, 0, 1), 4)
TOKENS = (5, 0, 3, 2)
HIDDEN, INTER, TOP_K = 16, 8, 3
CPU = torch.device("cpu")


# bf16 holds local ids up to 256 exactly: rank 0's 297 experts go over the wire in fp32
WIDE = ExpertPlacement((0,) * 297 + (1, 2, 3), 4)
CASES = {"fp32": (PLACEMENT, torch.float32), "bf16": (PLACEMENT, torch.bfloat16),
         "bf16_wide": (WIDE, torch.bfloat16)}  # fmt: skip


def experts_and_tokens(rank: int, num_experts: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Every expert's weights (the same on every rank) and this rank's tokens and routing."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen).to(dtype)
    down = torch.randn(num_experts, HIDDEN, INTER, generator=gen).to(dtype)
    gen.manual_seed(1 + rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=gen).to(dtype)
    scores = torch.rand(TOKENS[rank], num_experts, generator=gen)
    if num_experts > 8:  # route some tokens to rank 0's experts past 256
        scores[:, 256:297] += 1
    ids = torch.argsort(scores, dim=1, descending=True)[:, :TOP_K]
    weights = torch.rand(TOKENS[rank], TOP_K, generator=gen).to(dtype)
    return gate_up, down, x, weights, ids


def result_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"exchange.{rank}.pt"


def check_exchange(rank: int, world: int, out_dir: Path) -> None:
    """Every case on this rank; saves each one's answers and the one-process reference."""
    assert world == PLACEMENT.size
    saved = {}
    for name, (placement, dtype) in CASES.items():
        gate_up, down, x, weights, ids = experts_and_tokens(rank, placement.num_experts, dtype)
        grouped = create_moe_backend("grouped", CPU)
        mine = list(placement.local_experts(rank))

        def local(rows: torch.Tensor, w: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return grouped.experts(rows, w, local_ids, gate_up[mine], down[mine])  # noqa: B023

        exchange = TorchAllToAll(rank, placement, None, CPU)
        got = exchange.dispatch_combine(x, weights, ids, local)
        again = exchange.dispatch_combine(x.flip(0), weights.flip(0), ids.flip(0), local)
        want = grouped.experts(x, weights, ids, gate_up, down)
        saved[name] = {"got": got, "again": again, "want": want}
    torch.save(saved, result_path(out_dir, rank))
