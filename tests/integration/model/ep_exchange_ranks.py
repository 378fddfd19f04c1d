"""The all-to-all exchange as attention-DP ranks will call it, run on every rank of
``test_expert_parallel``'s world (4 gloo CPU processes) after its cases: each rank brings its
own number of tokens (5, 0, 3 and 2), under an uneven explicit placement (3, 2, 1 and 2
experts), and checks that it gets back each token's routed experts' weighted sum, as one
process holding every expert computes it; it saves the largest difference it saw."""

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


def experts_and_tokens(rank: int) -> tuple[torch.Tensor, ...]:
    """Every expert's weights (the same on every rank) and this rank's tokens and routing."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(8, 2 * INTER, HIDDEN, generator=gen)
    down = torch.randn(8, HIDDEN, INTER, generator=gen)
    gen.manual_seed(1 + rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=gen)
    ids = torch.argsort(torch.rand(TOKENS[rank], 8, generator=gen), dim=1)[:, :TOP_K]
    weights = torch.rand(TOKENS[rank], TOP_K, generator=gen)
    return gate_up, down, x, weights, ids


def result_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"exchange.{rank}.pt"


def check_exchange(rank: int, world: int, out_dir: Path) -> None:
    assert world == PLACEMENT.size
    gate_up, down, x, weights, ids = experts_and_tokens(rank)
    grouped = create_moe_backend("grouped", CPU)
    mine = list(PLACEMENT.local_experts(rank))

    def local(rows: torch.Tensor, w: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return grouped.experts(rows, w, local_ids, gate_up[mine], down[mine])

    exchange = TorchAllToAll(rank, PLACEMENT, None, CPU)
    got = exchange.dispatch_combine(x, weights, ids, local)
    again = exchange.dispatch_combine(x.flip(0), weights.flip(0), ids.flip(0), local)
    want = grouped.experts(x, weights, ids, gate_up, down)
    torch.save({"got": got, "again": again, "want": want}, result_path(out_dir, rank))
