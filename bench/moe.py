"""MoE expert compute: tokens grouped by expert against every expert over every token.

Prints one JSON line per backend, ``{"name": "moe", "backend", "tokens", "hidden",
"intermediate", "experts", "top_k", "dtype", "threads", "seconds", "tokens_per_s"}``, then
``{"name": "moe", "ratio"}`` (grouped tokens/s over naive). The shape is one Qwen3-30B-A3B
layer scaled down to a shared CPU (hidden 1024, expert intermediate 384, 64 experts, top 8;
the real layer is 2048 / 768 / 128 / 8); routing comes from a random router through the
same ``route``, and both backends run through the registry (``model.moe``) on the same
inputs, best of ``--repeats``, after a check that they agree. Compare within one run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from prefill_worker.model.hf_config import MoESpec
from prefill_worker.model.moe import create_moe_backend
from prefill_worker.model.moe.routing import route

CPU = torch.device("cpu")


def inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    h, i, e = args.hidden, args.intermediate, args.experts
    x = torch.randn(args.tokens, h, generator=g).to(dtype)
    router = (torch.randn(e, h, generator=g) * h**-0.5).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype)
    spec = MoESpec(e, args.top_k, i, frozenset({0}), norm_topk_prob=True)
    weights, ids = route(x, router, None, spec)
    return x, weights, ids, gate_up, down


def seconds(backend: str, args_in: tuple[torch.Tensor, ...], repeats: int) -> float:
    experts = create_moe_backend(backend, CPU)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        experts.experts(*args_in)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = inputs(args)
    with torch.no_grad():
        grouped = create_moe_backend("grouped", CPU).experts(*data)
        naive = create_moe_backend("naive", CPU).experts(*data)
        torch.testing.assert_close(grouped, naive, atol=1e-3, rtol=1e-3)
        rates = {}
        for backend in ("naive", "grouped"):
            took = seconds(backend, data, args.repeats)
            rates[backend] = args.tokens / took
            row = {"name": "moe", "backend": backend, "tokens": args.tokens}
            row |= {"hidden": args.hidden, "intermediate": args.intermediate}
            row |= {"experts": args.experts, "top_k": args.top_k, "dtype": args.dtype}
            row |= {"threads": args.threads, "seconds": round(took, 4)}
            print(json.dumps(row | {"tokens_per_s": round(rates[backend], 1)}), flush=True)
    print(json.dumps({"name": "moe", "ratio": round(rates["grouped"] / rates["naive"], 2)}))


if __name__ == "__main__":
    main()
