"""What the KV mirror costs the forward (``model/kv_mirror.py``: the forward writes vLLM's
staging blocks beside the pool's pages, each layer copied on the mirror's thread while the next
computes, docs/vllm.md "Layout"), for ``bench/vllm_pull.py``'s mirrored rows and on its own.

``forward_rows``: a real ``Runner`` forward of a small random Llama with the KV shape of
Llama-3-8B (32 layers, 8 KV heads of 128, bf16) and a narrow body (hidden 256, 8 query heads),
with and without every token mirrored: the runner's speed with the mirror against without,
the copies' own time on the mirror's thread, and the tail the forward waits for after its last
layer (what the mirror adds to a request's path). A real 8B forward is ~100x this one's FLOPs
per token for the same copies, so its ratio is closer to 1 than this one's.

    python bench/kv_mirror.py [--repeats 5] [--tokens 1024,2048]

One JSON line per prompt length::

    {"name": "kv_mirror_forward", "tokens", "forward_ms", "forward_mirror_ms", "mirror_ratio",
     "mirror_copy_ms", "mirror_copy_gb_s", "mirror_wait_ms", "memcpy_after_forward_gb_s",
     "memcpy_again_gb_s"}

``mirror_ratio`` is ``forward_ms / forward_mirror_ms`` (1.0: the mirror costs nothing);
``mirror_copy_ms`` the copies' time on the mirror's thread (every layer), ``mirror_copy_gb_s``
the KV bytes they moved over it; ``mirror_wait_ms`` what the forward waited for them after its
last layer. ``memcpy_after_forward_gb_s`` is a copy of the prompt's KV bytes right after a
forward, ``memcpy_again_gb_s`` the same copy once more: on the 2-core development VM a copy
right after seconds of matmul runs several times slower (the pull rows' READ sees the same).
Medians over the repeats, the first of each a warm-up; with and without alternate, so both
see the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.layout import LAYER_MAJOR
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.model.runner import Runner
from prefill_worker.request import SamplingParams
from prefill_worker.testing.random_model import LLAMA3_8B, random_runner

BLOCK_SIZE = 32
PAGE_SIZE = 16
# Llama-3-8B's KV (32 layers, 8 KV heads of 128) under a narrow body (hidden 256): 8 query
# heads of 128, so that the K/V the forward writes are 8B's, and a forward takes seconds here.
NARROW_8B_KV: dict[str, Any] = {
    **LLAMA3_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
}


@dataclass(frozen=True, slots=True)
class ForwardTimes:
    forward_s: float  # the runner's forward, the mirror's tail included
    copy_s: float  # the mirror's copies on its thread (0: nothing mirrored)
    wait_s: float  # what the forward waited for them after its last layer


def mirrored_forward(runner: Runner, plan: BatchPlan) -> ForwardTimes:
    """``Runner.forward(plan)`` as it runs, with the mirror's own times."""
    start = time.perf_counter()
    with torch.inference_mode():
        packed = runner.pack(plan)
        runner.attention.plan(packed.batch)
        with runner.kv_cache.mirroring(packed.mirror) as writes:
            runner.model.forward(packed.inputs, runner.kv_cache, runner.attention)
    forward_s = time.perf_counter() - start
    if writes is None:
        return ForwardTimes(forward_s, 0.0, 0.0)
    return ForwardTimes(forward_s, writes.copy_s, writes.wait_s)


def narrow_runner(num_pages: int, pool_layout: str = LAYER_MAJOR) -> Runner:
    """A runner of ``NARROW_8B_KV`` over a pool of ``num_pages`` pages in ``pool_layout``."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    runner, _ = random_runner(
        NARROW_8B_KV, torch.bfloat16, cpu, "sdpa", PAGE_SIZE, num_pages, 0, pool_layout
    )
    return runner


def paired_blocks(kv: KVCache, num_blocks: int) -> list[np.ndarray]:
    """A zeroed staging region in vLLM's layout for ``kv``'s shape (untouched, as the
    worker's: the warm-up repeat takes its page faults)."""
    lay = kv.layout
    shape = (num_blocks, lay.num_kv_heads, BLOCK_SIZE, 2 * lay.head_dim)
    return [np.zeros(shape, np.uint16) for _ in range(lay.num_layers)]


def forward_rows(tokens: int, repeats: int) -> dict[str, Any]:
    """The runner's forward of one ``tokens``-token prompt, with and without the mirror."""
    num_pages = tokens // PAGE_SIZE
    runner = narrow_runner(num_pages)
    vocab_size = runner.model.spec.vocab_size
    mirror = KVMirror(paired_blocks(runner.kv_cache, tokens // BLOCK_SIZE), torch.bfloat16)
    runner.kv_cache.attach_mirror(mirror)
    ids = torch.randint(0, vocab_size, (tokens,)).tolist()
    greedy = SamplingParams(temperature=0.0)
    pages = list(np.random.default_rng(0).permutation(num_pages))
    slots = list(range(tokens))
    plain = BatchPlan(1, (ChunkPlan("p", ids, 0, tokens, pages, greedy),))
    mirrored = BatchPlan(1, (ChunkPlan("p", ids, 0, tokens, pages, greedy, mirror_slots=slots),))
    lay = runner.kv_cache.layout
    kv_bytes = tokens * lay.num_layers * 2 * lay.page_bytes // lay.page_size  # K and V
    source, target = np.ones(kv_bytes, np.uint8), np.zeros(kv_bytes, np.uint8)
    times: dict[str, list[ForwardTimes]] = {"plain": [], "mirror": []}
    memcpy: dict[str, list[float]] = {"after": [], "again": []}
    for _ in range(repeats + 1):
        for name, plan in (("plain", plain), ("mirror", mirrored)):
            times[name].append(mirrored_forward(runner, plan))
        for name in ("after", "again"):
            start = time.perf_counter()
            np.copyto(target, source)
            memcpy[name].append(kv_bytes / (time.perf_counter() - start) / 1e9)
    median = statistics.median
    plain_s, mirror_s = (median(t.forward_s for t in times[n][1:]) for n in ("plain", "mirror"))
    copy_s = median(t.copy_s for t in times["mirror"][1:])
    return {
        "name": "kv_mirror_forward",
        "tokens": tokens,
        "forward_ms": round(plain_s * 1e3, 2),
        "forward_mirror_ms": round(mirror_s * 1e3, 2),
        "mirror_ratio": round(plain_s / mirror_s, 3),
        "mirror_copy_ms": round(copy_s * 1e3, 2),
        "mirror_copy_gb_s": round(kv_bytes / copy_s / 1e9, 2),
        "mirror_wait_ms": round(median(t.wait_s for t in times["mirror"][1:]) * 1e3, 3),
        "memcpy_after_forward_gb_s": round(median(memcpy["after"][1:]), 2),
        "memcpy_again_gb_s": round(median(memcpy["again"][1:]), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", default="1024,2048")
    args = parser.parse_args()
    for tokens in (int(t) for t in args.tokens.split(",")):
        print(json.dumps(forward_rows(tokens, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
