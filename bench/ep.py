"""Expert parallelism's cost: TP 2 / EP 2 and DP 2 / EP 2 against TP 2, same MoE model, one run.

A random checkpoint of a scaled-down Qwen3-MoE shape (fp32; 4 layers, all sparse, hidden
1024, 64 experts of intermediate 384, top 8, 16 heads, 4 KV heads), one prompt of
``--prompt-tokens``, prefilled by the worker's runner (``model.build(..., tp=..., ep_size=...)``)
in two groups of two rank processes (one thread each, gloo on 127.0.0.1) that live side by
side::

    TP 2          every rank holds every expert's half (I/2), one all-reduce per MoE block
    TP 2 / EP 2   every rank holds 32 whole experts; each rank's half of the tokens goes to
                  the experts' owners by all-to-all and back, then the same all-reduce

The parent steps the two in turn (``--repeats`` rounds, best of each), so a noisy neighbour
hurts both alike. Each rank times its ``all_to_all_single`` and ``all_gather`` calls (the
exchange's collectives, by wrapping ``torch.distributed``'s, waits for the slower rank
included): ``all_to_all_share`` is that over the rank's forward time, mean of the ranks of the
best EP round. Prints, and appends to ``bench/results/ep.json``::

    {"name": "ep", "ep": 2, "ratio": ..., "all_to_all_share": ..., "tokens_per_s": ...,
     "tp2_tokens_per_s": ..., "device": "cpu", ...}

``ratio`` is EP 2's throughput over TP 2's. Goal on a 2-core CPU: ratio >= 0.9 (the gain of
EP is on GPUs, where whole experts make bigger GEMMs and DeepEP overlaps the exchange; here it
must not lose). Compare within one run only.

The same run then measures attention DP with the experts shared (``ep_size`` = ``dp_size``):
a third group, DP 2 / EP 2, two rank processes each prefilling its own prompt (two prompts of
``--prompt-tokens``) through the worker's lockstep (``dp.lockstep``: a vote, then both ranks'
forwards, every sparse layer's tokens exchanged with the experts' owners), against the TP-2
group prefilling the same two prompts as one batch, both stepped in the same rounds::

    {"name": "ep", "ep": 2, "dp": 2, "ratio": ..., "all_to_all_share": ...,
     "tokens_per_s": ..., "tp2_tokens_per_s": ..., "tokens": 2 x prompt, ...}

Goal on CPU: that ``ratio`` (DP 2 / EP 2 over TP 2, the same tokens) >= 0.9.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench.tp import Group, Setup, make_checkpoint, prompt_plan
from prefill_worker.batch import BatchPlan
from prefill_worker.dp.lockstep import Bell, Lockstep, bell_path
from prefill_worker.model import TPGroup, build

RESULTS = Path(__file__).resolve().parent / "results"
PAGE_SIZE = 16
QWEN3_MOE_SMALL = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
    "intermediate_size": 2048, "moe_intermediate_size": 384, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip
EXCHANGE_CALLS = ("all_to_all_single", "all_gather")


class ExchangeClock:
    """Wraps the exchange's ``torch.distributed`` calls in this process; sums their wall time
    (gloo returns when the data has arrived)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in EXCHANGE_CALLS:
            setattr(torch.distributed, name, self._timed(getattr(torch.distributed, name)))

    def _timed(self, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            out = call(*args, **kwargs)
            self.seconds += time.perf_counter() - began
            return out

        return timed

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _worker(setup: Setup, kind: str, rank: int, port: int, conn: Connection) -> None:
    """One rank of ``kind`` (``tp2``, ``tp2_ep2``, ``dp2_ep2``): build, warm up, then one
    timed forward per ``("run", plan)``, answering ``(forward_s, exchange_s)``; ``"stop"``
    ends it. Plans: ``one`` (the first prompt), ``both`` (two prompts; a DP rank: its own)."""
    torch.set_num_threads(setup.num_threads)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    group = TPGroup(rank, 2, torch.distributed.new_group([0, 1]))  # the barrier has WORLD
    pages = 2 * -(-setup.prompt_tokens // PAGE_SIZE)
    where = {"dp": group} if kind == "dp2_ep2" else {"tp": group}
    ep_size = 1 if kind == "tp2" else 2
    runner, _, info = build(setup.checkpoint, setup.dtype, "cpu", page_size=PAGE_SIZE,
                            num_pages=pages, ep_size=ep_size, **where)  # fmt: skip
    both = prompt_plan(dataclasses.replace(setup, num_prompts=2), info.vocab_size)
    plans = {"one": prompt_plan(setup, info.vocab_size), "both": both}
    forward: Any = runner
    if kind == "dp2_ep2":  # each rank its own prompt, every forward in the lockstep
        plans = {"both": BatchPlan(0, (both.chunks[rank],))}
        bell = Bell(bell_path(setup.checkpoint), listen=rank == 0)
        torch.distributed.barrier()  # rank 0's bell is bound before rank 1 rings it
        forward = Lockstep(runner, rank, group.group, bell, interval_s=1.0)
        forward.start()
    clock = ExchangeClock()
    for plan in plans.values():
        forward.run(plan)  # warm-up
    conn.send("ready")
    while (message := conn.recv()) != "stop":
        torch.distributed.barrier()
        clock.take_seconds()  # drop the warm-up's
        start = time.perf_counter()
        forward.run(plans[message[1]])
        conn.send((time.perf_counter() - start, clock.take_seconds()))
    if isinstance(forward, Lockstep):
        forward.stop(30.0)
    torch.distributed.destroy_process_group()


RUNS = (("tp2", "one"), ("tp2_ep2", "one"), ("tp2", "both"), ("dp2_ep2", "both"))


def measure(setup: Setup, repeats: int, deadline: float) -> list[dict[str, object]]:
    groups: dict[str, Group] = {}
    best: dict[tuple[str, str], tuple[float, float]] = {}
    try:
        for kind in ("tp2", "tp2_ep2", "dp2_ep2"):  # one at a time: loading is memory-bound
            args = lambda rank, port, conn, kind=kind: (setup, kind, rank, port, conn)  # noqa: E731
            groups[kind] = Group(2, _worker, args, deadline)
            groups[kind].wait_ready()
        for _ in range(repeats):
            for kind, plan in RUNS:
                seconds, share = groups[kind].round(("run", plan))
                if (kind, plan) not in best or seconds < best[kind, plan][0]:
                    best[kind, plan] = (seconds, share)
    finally:
        for group in groups.values():
            group.close()
    rows = []
    for kind, plan, extra in (("tp2_ep2", "one", {}), ("dp2_ep2", "both", {"dp": 2})):
        tokens = setup.prompt_tokens * (2 if plan == "both" else 1)
        (seconds, share), (tp2_seconds, _) = best[kind, plan], best["tp2", plan]
        row = {"name": "ep", "ep": 2, **extra, "ratio": round(tp2_seconds / seconds, 3),
               "all_to_all_share": round(share, 3), "tokens_per_s": round(tokens / seconds, 1),
               "tp2_tokens_per_s": round(tokens / tp2_seconds, 1), "device": "cpu",
               "dtype": setup.dtype, "tokens": tokens,
               "load_average": round(os.getloadavg()[0], 1)}  # fmt: skip
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "ep.json", help="appended to")
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline_s
    with tempfile.TemporaryDirectory(prefix="ep-bench-") as tmp:
        make_checkpoint(QWEN3_MOE_SMALL, Path(tmp), torch.float32)
        setup = Setup(tmp, "cpu", "float32", args.prompt_tokens, 1, 1)
        rows = measure(setup, args.repeats, deadline)
    with args.out.open("a") as out:
        for row in rows:
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
