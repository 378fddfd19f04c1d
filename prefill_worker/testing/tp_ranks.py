"""The tensor-parallel worker with test seams: a rank whose forward raises, pools saved at exit.

A test tool, never imported by the worker. ``python -m prefill_worker.testing.tp_ranks
[--fail-rank R --fail-on MARKER] [--dump-dir DIR] serve CONFIG --set ...`` runs
``prefill-worker serve`` with two seams of the daemon (``build_model``, ``rank_command``):

- ``--fail-rank R --fail-on MARKER``: rank R's forward raises ``RuntimeError`` for any batch
  holding a chunk of a request whose id contains MARKER (deterministic: the test names the
  request that fails, warm-up and other requests run normally);
- ``--fail-how stop`` (with ``--fail-rank R --fail-on MARKER``): rank R stops itself
  (SIGSTOP) at the start of such a forward instead, as a rank frozen mid-forward would be;
- ``--dump-dir DIR``: every rank saves its whole KV pool at exit, as ``DIR/rank{R}.pt``
  (``{"k": [L][P, page_size, KV, D], "v": ...}``; a hybrid model's also its own state pool,
  ``"conv"`` ``[L, slots, C / N, K - 1]`` and ``"recurrent"`` ``[L, slots, Hv / N, Dk, Dv]``,
  this rank's heads), so a test can compare the ranks' head slices with a TP-1 worker's pool;
- ``--dump-on-signal`` (with ``--dump-dir``): also on each SIGUSR2, while it serves (written
  aside, then renamed: the file appears whole), so a test can read the pool of a live worker
  after a request, before later requests reuse its pages. Only a worker with no request in
  flight is dumped consistently (the forward runs on its own thread).

The leader starts its followers as ``python -m prefill_worker.testing.tp_ranks <the same
options> rank --rank ...``, so they carry the same seams.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner
from prefill_worker.model import KVCache, build
from prefill_worker.service import cli, rank


class FailingRunner:
    def __init__(self, runner: ModelRunner, rank: int, marker: str, how: str = "raise") -> None:
        self._runner, self._rank, self._marker, self._how = runner, rank, marker, how

    def run(self, plan: BatchPlan) -> BatchOutput:
        if any(self._marker in chunk.request_id for chunk in plan.chunks):
            if self._how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # the leader's collectives now wait
            else:
                raise RuntimeError(f"injected forward failure on rank {self._rank}")
        return self._runner.run(plan)


def dump_pool(kv_cache: KVCache, path: Path, state: Any = None) -> None:
    """``state``: a hybrid model's ``StateCache`` (this rank's heads), dumped beside."""
    layout = kv_cache.layout
    k, v = [], []
    for layer in range(layout.num_layers):
        pages = range(len(kv_cache.k[layer]))  # a windowed pool's sliding layers: their own
        both = [kv_cache.read_page(layer, page) for page in pages]
        k.append(torch.stack([pair[0] for pair in both]).clone())
        v.append(torch.stack([pair[1] for pair in both]).clone())
    dump: dict[str, Any] = {"k": k, "v": v}
    if state is not None:
        dump["conv"] = state.stacked_conv.clone()
        dump["recurrent"] = state.stacked_recurrent.clone()
    partial = path.with_suffix(".partial")
    dump["mirror"] = kv_cache.has_mirror
    torch.save(dump, partial)
    os.replace(partial, path)


def dump_on_signal(kv_cache: KVCache, path: Path, state: Any = None) -> None:
    """SIGUSR2 dumps the pool (a handler of the main thread, where the daemon builds it)."""
    signal.signal(signal.SIGUSR2, lambda *_: dump_pool(kv_cache, path, state))


def builder(options: argparse.Namespace) -> Callable[..., Any]:
    def build_with_seams(*args: Any, **kwargs: Any) -> Any:
        runner, kv_cache, info = build(*args, **kwargs)
        rank_index = kwargs["tp"].rank
        if options.dump_dir:
            path = Path(options.dump_dir) / f"rank{rank_index}.pt"
            state = getattr(getattr(runner, "model", None), "state", None)  # a hybrid's
            atexit.register(dump_pool, kv_cache, path, state)
            if options.dump_on_signal:
                dump_on_signal(kv_cache, path, state)
        if options.fail_on and options.fail_rank == rank_index:
            failing = FailingRunner(runner, rank_index, options.fail_on, options.fail_how)
            return failing, kv_cache, info
        return runner, kv_cache, info

    return build_with_seams


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prefill_worker.testing.tp_ranks")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-on", default="")
    parser.add_argument("--fail-how", choices=["raise", "stop"], default="raise")
    parser.add_argument("--dump-dir", default="")
    parser.add_argument("--dump-on-signal", action="store_true")
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
