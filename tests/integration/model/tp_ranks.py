"""Runs a tensor-parallel group of real processes (gloo on CPU, 127.0.0.1) over the runner.

``run_group`` starts ``size`` ranks; each builds every case's checkpoint at its rank, runs the
same two batches (a chunked prompt beside a short one, then the rest of the chunked one) and
saves the logits and its pool's K/V of both prompts. Every join has a deadline; a rank left
alive past it is killed, so a stuck collective fails the test instead of hanging it.

Ranks come from a forkserver that has imported torch and the model once (a fresh interpreter
per rank costs seconds on a loaded machine; forking the test process itself is unsafe once it
has run OpenMP). This module imports nothing of transformers, for the same reason.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import TPGroup, build
from prefill_worker.request import SamplingParams
from prefill_worker.testing.launch import free_port

SPLIT = 32  # the long prompt is prefilled in two chunks, [0, 32) and the rest
PAGE_SIZE, NUM_PAGES = 16, 16
PAGES_LONG, PAGES_SHORT = [15, 11, 7], [13, 9]  # scattered, descending
DEADLINE_S = 120.0


def run_group(
    size: int, cases: dict[str, Path], long: list[int], short: list[int], out_dir: Path
) -> None:
    """Run every case on a ``size``-rank group; results in ``out_dir/<case>.<rank>.pt``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "prefill_worker.model", __name__])
    port = free_port()
    args = (size, port, cases, long, short, out_dir)
    ranks = [context.Process(target=_rank_main, args=(rank, *args)) for rank in range(size)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(10)
    codes = [process.exitcode for process in ranks]
    assert codes == [0] * size, f"rank exit codes {codes} (None: killed at the deadline)"


def _rank_main(
    rank: int,
    size: int,
    port: int,
    cases: dict[str, Path],
    long: list[int],
    short: list[int],
    out_dir: Path,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets on the loopback too
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=60),
    )
    try:
        tp = TPGroup(rank, size, torch.distributed.group.WORLD)
        for name, path in cases.items():
            torch.save(_run_case(path, tp, long, short), out_dir / f"{name}.{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _run_case(path: Path, tp: TPGroup, long: list[int], short: list[int]) -> dict[str, object]:
    runner, kv_cache, info = build(
        path, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES, tp=tp
    )
    first = runner.compute_logits(
        BatchPlan(
            0,
            (
                _chunk("long", long, 0, SPLIT, PAGES_LONG),
                _chunk("short", short, 0, len(short), PAGES_SHORT),
            ),
        )
    )
    second = runner.compute_logits(
        BatchPlan(1, (_chunk("long", long, SPLIT, len(long), PAGES_LONG),))
    )
    layers = range(info.num_layers)
    return {
        "short_logits": first[0].clone(),
        "long_logits": second[0].clone(),
        "short_kv": [_paged_kv(kv_cache, PAGES_SHORT, len(short), i) for i in layers],
        "long_kv": [_paged_kv(kv_cache, PAGES_LONG, len(long), i) for i in layers],
    }


def _chunk(request_id: str, ids: list[int], start: int, end: int, pages: list[int]) -> ChunkPlan:
    sampling = SamplingParams() if end == len(ids) else None
    return ChunkPlan(request_id, ids[start:end], start, end, pages, sampling)


def _paged_kv(kv_cache, pages: list[int], length: int, layer: int):  # type: ignore[no-untyped-def]
    """This rank's K and V of positions [0, length): ``[length, local KV, D]`` each (an MLA
    pool: its latent rows alone, ``[length, 1, r + rope]``)."""
    k = torch.cat([kv_cache.k[layer][p] for p in pages])[:length]
    if not kv_cache.v:
        return (k.clone(),)
    v = torch.cat([kv_cache.v[layer][p] for p in pages])[:length]
    return k.clone(), v.clone()
