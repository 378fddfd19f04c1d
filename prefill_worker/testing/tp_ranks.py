"""The tensor-parallel worker with test seams: a rank whose forward raises, pools saved at exit.

A test tool, never imported by the worker. ``python -m prefill_worker.testing.tp_ranks
[--fail-rank R --fail-on MARKER] [--dump-dir DIR] serve CONFIG --set ...`` runs
``prefill-worker serve`` with two seams of the daemon (``build_model``, ``rank_command``):

- ``--fail-rank R --fail-on MARKER``: rank R's forward raises ``RuntimeError`` for any batch
  holding a chunk of a request whose id contains MARKER (deterministic: the test names the
  request that fails, warm-up and other requests run normally);
- ``--dump-dir DIR``: every rank saves its whole KV pool at exit, as ``DIR/rank{R}.pt``
  (``{"k": [L][P, page_size, KV, D], "v": ...}``), so a test can compare the ranks' head
  slices with a TP-1 worker's pool.

The leader starts its followers as ``python -m prefill_worker.testing.tp_ranks <the same
options> rank --rank ...``, so they carry the same seams.
"""

from __future__ import annotations

import argparse
import atexit
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner
from prefill_worker.model import KVCache, build
from prefill_worker.service import cli, rank


class FailingRunner:
    def __init__(self, runner: ModelRunner, rank: int, marker: str) -> None:
        self._runner, self._rank, self._marker = runner, rank, marker

    def run(self, plan: BatchPlan) -> BatchOutput:
        if any(self._marker in chunk.request_id for chunk in plan.chunks):
            raise RuntimeError(f"injected forward failure on rank {self._rank}")
        return self._runner.run(plan)


def dump_pool(kv_cache: KVCache, path: Path) -> None:
    layout = kv_cache.layout
    pages = range(layout.num_pages)
    k, v = [], []
    for layer in range(layout.num_layers):
        both = [kv_cache.read_page(layer, page) for page in pages]
        k.append(torch.stack([pair[0] for pair in both]).clone())
        v.append(torch.stack([pair[1] for pair in both]).clone())
    torch.save({"k": k, "v": v}, path)


def builder(options: argparse.Namespace) -> Callable[..., Any]:
    def build_with_seams(*args: Any, **kwargs: Any) -> Any:
        runner, kv_cache, info = build(*args, **kwargs)
        rank_index = kwargs["tp"].rank
        if options.dump_dir:
            atexit.register(dump_pool, kv_cache, Path(options.dump_dir) / f"rank{rank_index}.pt")
        if options.fail_on and options.fail_rank == rank_index:
            return FailingRunner(runner, rank_index, options.fail_on), kv_cache, info
        return runner, kv_cache, info

    return build_with_seams


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prefill_worker.testing.tp_ranks")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-on", default="")
    parser.add_argument("--dump-dir", default="")
    parser.add_argument("command", choices=["serve", "rank"])
    options, rest = parser.parse_known_args(argv)
    own = argv[: argv.index(options.command)]
    build_model = builder(options)
    if options.command == "rank":
        return rank.main(rest, build_model=build_model)
    rank_command = [sys.executable, "-m", "prefill_worker.testing.tp_ranks", *own, "rank"]
    return cli.main(["serve", *rest], build_model=build_model, rank_command=rank_command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
