"""Runs attention-DP ranks sharing their experts (``ep_size`` = ``dp_size``) as real processes
(gloo on CPU, 127.0.0.1): each rank builds its model over its DP group, steps through a
``dp.lockstep.Lockstep`` (rank 0 of the group driving, the others ringing its bell), and runs
its own plans in three phases, a barrier (on a group of its own) between them::

    phase 0   rank 0 alone: "long" in two chunks, [0, 32) then the rest    (the others idle)
    phase 1   the last rank alone: "short"                                 (the others idle)
    phase 2   every rank its own "own{r}" at once (lengths differ)

A world of 4 ranks holds DP-2 groups {0, 1} and {2, 3} (cases dealt round-robin, side by
side), then a DP-4 group of all four. Each rank saves its prompts' greedy first tokens and
logprobs, its pool's K/V (or MLA rows) for them, and its step counts (``Lockstep.counts``).
Every join has a deadline; a rank left alive past it is killed, so a stuck lockstep fails
the test instead of hanging it.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.dp.lockstep import Bell, Lockstep, bell_path
from prefill_worker.model import TPGroup, build
from prefill_worker.request import SamplingParams
from prefill_worker.testing.launch import free_port
from tests.integration.model.tp_ranks import spawn_ranks

SPLIT, PAGE_SIZE, NUM_PAGES = 32, 16, 16
PAGES = {"long": [15, 11, 7], "short": [13, 9], "own": [5, 3]}
DEADLINE_S = 180.0
WORLD = 4


def prompts(size: int) -> dict[str, list[int]]:
    """Every prompt of a DP ``size`` group (ids below the tiny models' vocabulary)."""
    gen = torch.Generator().manual_seed(7)
    out = {"long": torch.randint(0, 128, (45,), generator=gen).tolist()}
    out["short"] = torch.randint(0, 128, (20,), generator=gen).tolist()
    for rank in range(size):
        out[f"own{rank}"] = torch.randint(0, 128, (5 + 7 * rank,), generator=gen).tolist()
    return out


def pages_of(key: str) -> list[int]:
    return PAGES["own" if key.startswith("own") else key]


def plans(key: str, ids: list[int]) -> list[BatchPlan]:
    """``long`` in two chunks, any other prompt whole."""
    bounds = [(0, SPLIT), (SPLIT, len(ids))] if key == "long" else [(0, len(ids))]
    return [
        BatchPlan(i, (ChunkPlan(key, ids[a:b], a, b, pages_of(key), sampling),))
        for i, (a, b) in enumerate(bounds)
        for sampling in [SamplingParams() if b == len(ids) else None]
    ]


def result_path(out_dir: Path, name: str, size: int, rank: int) -> Path:
    return out_dir / f"{name}.dp{size}.{rank}.pt"


def run_world(cases: dict[int, list[tuple[str, Path]]], out_dir: Path) -> None:
    """``cases[size]``: (name, checkpoint) per DP ``size`` group (size 2: one per group)."""
    bells = tempfile.mkdtemp(prefix="dp-ep-bells-")
    args = (free_port(), cases, out_dir, bells)
    spawn_ranks(_rank_main, WORLD, args, __name__, DEADLINE_S)


def _rank_main(
    rank: int, port: int, cases: dict[int, list[tuple[str, Path]]], out_dir: Path, bells: str
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        for size in sorted(cases):
            groups = []  # every rank creates every group, in one order (new_group's rule)
            for first in range(0, WORLD, size):
                members = list(range(first, first + size))
                steps, phases = dist.new_group(members), dist.new_group(members)
                groups.append((first, steps, phases))
            for index, (first, steps, phases) in enumerate(groups):
                if not first <= rank < first + size:
                    continue
                for name, checkpoint in cases[size][index :: len(groups)]:  # dealt round-robin
                    where = os.path.join(bells, f"{name}.dp{size}")
                    dp = TPGroup(rank - first, size, steps)
                    saved = _run_case(checkpoint, dp, phases, where)
                    torch.save(saved, result_path(out_dir, name, size, rank - first))
    finally:
        dist.destroy_process_group()


def _run_case(checkpoint: Path, dp: TPGroup, phases, where: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    runner, kv_cache, info = build(
        checkpoint, dtype="float32", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
        ep_size=dp.size, dp=dp,
    )  # fmt: skip
    os.makedirs(where, exist_ok=True)
    bell = Bell(bell_path(where), listen=dp.rank == 0)
    torch.distributed.barrier(group=phases)  # rank 0's bell is bound before any rings
    lockstep = Lockstep(runner, dp.rank, dp.group, bell, interval_s=0.5)
    lockstep.start()
    ids = prompts(dp.size)
    mine = [
        ["long"] if dp.rank == 0 else [],
        ["short"] if dp.rank == dp.size - 1 else [],
        [f"own{dp.rank}"],
    ]
    saved: dict[str, object] = {}
    for keys in mine:
        torch.distributed.barrier(group=phases)
        for key in keys:
            for plan in plans(key, ids[key]):
                output = lockstep.run(plan)
            saved[f"{key}_token"] = output.sampled[0].token_id
            saved[f"{key}_logprob"] = output.sampled[0].logprob
            length = len(ids[key])
            saved[f"{key}_kv"] = paged_kv(kv_cache, pages_of(key), length, info.num_layers)
    torch.distributed.barrier(group=phases)
    lockstep.stop(30.0)
    assert lockstep.failure is None, lockstep.failure
    counts = lockstep.counts
    saved["counts"] = (counts.busy, counts.idle, counts.votes)
    return saved


def paged_kv(kv_cache, pages: list[int], length: int, num_layers: int) -> list[tuple]:  # type: ignore[no-untyped-def]
    out = []
    for layer in range(num_layers):
        k = torch.cat([kv_cache.k[layer][p] for p in pages])[:length].clone()
        if not kv_cache.v:
            out.append((k,))
            continue
        out.append((k, torch.cat([kv_cache.v[layer][p] for p in pages])[:length].clone()))
    return out
