"""The all-to-all exchange as attention-DP ranks will call it: each rank of a real gloo
group (3 CPU processes on 127.0.0.1) brings its own number of tokens (5, 0 and 3), and gets
back each token's routed experts' weighted sum, computed by the experts' owners under an
uneven explicit placement, equal to one process holding every expert."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import torch

from prefill_worker.model.moe import create_moe_backend
from prefill_worker.model.moe.alltoall import TorchAllToAll
from prefill_worker.model.moe.placement import ExpertPlacement
from prefill_worker.testing.launch import free_port

PLACEMENT = ExpertPlacement((2, 0, 0, 1, 2, 2, 0, 1), 3)  # 3, 2 and 3 experts
TOKENS = (5, 0, 3)
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


def _rank(rank: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        gate_up, down, x, weights, ids = experts_and_tokens(rank)
        grouped = create_moe_backend("grouped", CPU)
        mine = list(PLACEMENT.local_experts(rank))

        def local(rows, w, local_ids):  # type: ignore[no-untyped-def]
            return grouped.experts(rows, w, local_ids, gate_up[mine], down[mine])

        exchange = TorchAllToAll(rank, PLACEMENT, None, CPU)
        got = exchange.dispatch_combine(x, weights, ids, local)
        want = grouped.experts(x, weights, ids, gate_up, down)
        assert got.shape == (TOKENS[rank], HIDDEN)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # a second call reuses nothing stale: other tokens, the same answer rule
        again = exchange.dispatch_combine(x.flip(0), weights.flip(0), ids.flip(0), local)
        torch.testing.assert_close(again, want.flip(0), atol=1e-5, rtol=1e-5)
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_with_different_token_counts_get_their_experts_sums():
    context = multiprocessing.get_context("forkserver")
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port)) for rank in range(3)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join(10)
    assert [p.exitcode for p in ranks] == [0, 0, 0]
