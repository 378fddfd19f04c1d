"""Prefill and decode throughput of one model on this machine, and the prefill:decode worker
ratio they imply (docs/deploy.md, "How many prefill workers per decode worker").

Prefill: our runner, packed plans of ``--prefill-tokens`` tokens (prompts of 512). Decode:
``transformers`` ``generate`` as a stand-in decode engine (greedy, KV cache on), batches of
1, 8 and 32 sequences after a 128-token prompt; decode tokens/s is the extra time of 17 new
tokens over 1. Same weights, dtype and torch threads for both. Prints one JSON line per
measurement, then one per workload (mean uncached prompt tokens L_in, output tokens L_out)::

    {"name": "pd_ratio", "l_in": 1024, "l_out": 256, "prefill_tok_s": P, "decode_tok_s": D,
     "prefill_workers_per_decode_worker": (L_in · D) / (L_out · P)}

    python bench/pd_ratio.py --model models/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.request import SamplingParams

PAGE_SIZE = 16
PROMPT = 512
WORKLOADS = ((1024, 256), (4096, 256), (2048, 1024), (512, 512))


def best_s(fn: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def prefill_tok_s(model: str, num_tokens: int) -> float:
    num_prompts = num_tokens // PROMPT
    pages_per_prompt = PROMPT // PAGE_SIZE
    runner, _, _ = build(model, "float32", page_size=PAGE_SIZE, num_pages=num_prompts * 40)
    gen = torch.Generator().manual_seed(0)
    chunks = tuple(
        ChunkPlan(
            f"r{i}",
            torch.randint(100, 20000, (PROMPT,), generator=gen).tolist(),
            0,
            PROMPT,
            list(range(i * pages_per_prompt, (i + 1) * pages_per_prompt)),
            SamplingParams(),
        )
        for i in range(num_prompts)
    )
    plan = BatchPlan(1, chunks)
    runner.run(plan)  # warm-up
    return num_tokens / best_s(lambda: runner.run(plan))


def decode_tok_s(model: str, batch: int) -> float:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.randint(100, 20000, (batch, 128), generator=torch.Generator().manual_seed(1))

    def generate(num_new: int) -> None:
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                pad_token_id=0,
            )

    generate(2)  # warm-up
    return batch * 16 / (best_s(lambda: generate(17), 2) - best_s(lambda: generate(1), 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = {"model": args.model, "dtype": "float32", "device": "cpu", "threads": args.threads}
    prefill = prefill_tok_s(args.model, args.prefill_tokens)
    print(json.dumps({"name": "prefill", **common, "tok_s": round(prefill, 1)}), flush=True)
    decode = {}
    for batch in (1, 8, 32):
        decode[batch] = decode_tok_s(args.model, batch)
        print(
            json.dumps(
                {"name": "decode", **common, "batch": batch, "tok_s": round(decode[batch], 1)}
            ),
            flush=True,
        )
    best = max(decode.values())
    for l_in, l_out in WORKLOADS:
        ratio = (l_in * best) / (l_out * prefill)
        print(
            json.dumps(
                {
                    "name": "pd_ratio",
                    "l_in": l_in,
                    "l_out": l_out,
                    "prefill_tok_s": round(prefill, 1),
                    "decode_tok_s": round(best, 1),
                    "prefill_workers_per_decode_worker": round(ratio, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
