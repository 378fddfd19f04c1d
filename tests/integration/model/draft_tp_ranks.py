"""Runs drafting runners at TP 2 in two real processes (gloo on CPU, 127.0.0.1) for
``test_draft_tp.py``: each rank builds the target and its draft with ``model.build(tp=...)``,
runs the batches of ``test_eagle_draft`` (prompt b's first chunk; then prompt a whole beside
b's rest) and saves its sampled tokens' proposals and its draft pool's rows of both prompts.
Imports nothing of transformers (the ranks come from a forkserver, as in ``tp_ranks``)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import TPGroup, build
from prefill_worker.request import SamplingParams
from prefill_worker.testing.launch import free_port
from tests.integration.model.tp_ranks import spawn_ranks

SIZE, PAGE_SIZE, NUM_PAGES, TOPK, SPLIT = 2, 16, 16, 4, 32
PAGES = {"a": [15, 11, 7, 3], "b": [14, 10, 6, 2, 12]}  # scattered, descending
DEADLINE_S = 180.0


def result_path(out_dir: Path, name: str, rank: int) -> Path:
    return out_dir / f"{name}.{rank}.pt"


def run_ranks(cases: dict[str, tuple[str, Path, Path | None]], prompts: dict[str, list[int]],
              out_dir: Path) -> None:  # fmt: skip
    """``cases[name]``: (draft kind, target, draft checkpoint or None), each at TP 2."""
    args = (free_port(), cases, prompts, out_dir)
    spawn_ranks(_rank_main, SIZE, args, __name__, DEADLINE_S)


def _rank_main(rank: int, port: int, cases: dict[str, tuple[str, Path, Path | None]],
               prompts: dict[str, list[int]], out_dir: Path) -> None:  # fmt: skip
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        tp = TPGroup(rank, SIZE, dist.group.WORLD)
        for name, (kind, target, draft) in sorted(cases.items()):
            saved = _run_case(kind, target, draft, tp, prompts)
            torch.save(saved, result_path(out_dir, name, rank))
    finally:
        dist.destroy_process_group()


def _run_case(kind: str, target: Path, draft: Path | None, tp: TPGroup,
              prompts: dict[str, list[int]]) -> dict[str, object]:  # fmt: skip
    runner, _, _ = build(
        target, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
        tp=tp, draft=kind, draft_topk=TOPK, draft_path=draft,
    )  # fmt: skip
    a, b = prompts["a"], prompts["b"]
    runner.run(_plan(ChunkPlan("b", b[:SPLIT], 0, SPLIT, PAGES["b"], None, next_token_id=b[SPLIT])))
    out = runner.run(
        _plan(
            ChunkPlan("a", a, 0, len(a), PAGES["a"], SamplingParams()),
            ChunkPlan("b", b[SPLIT:], SPLIT, len(b), PAGES["b"], SamplingParams()),
        )
    )
    saved: dict[str, object] = {}
    for sampled, key in zip(out.sampled, ("a", "b"), strict=True):
        assert sampled.draft is not None
        saved[key] = (sampled.token_id, sampled.draft)
        pool, length = runner.draft_kv, len(prompts[key])  # type: ignore[attr-defined]
        k = torch.cat([pool.k[0][p] for p in PAGES[key]])[:length].clone()
        v = torch.cat([pool.v[0][p] for p in PAGES[key]])[:length].clone() if pool.v else None
        saved[f"{key}_kv"] = (k, v)  # an MLA pool: no v
    return saved


def _plan(*chunks: ChunkPlan) -> BatchPlan:
    return BatchPlan(0, chunks)
