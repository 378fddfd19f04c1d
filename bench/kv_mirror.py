"""What the KV mirror costs the forward (``model/kv_cache.py``: the forward writes vLLM's staging
blocks beside the pool's pages, docs/vllm.md "Layout"), for ``bench/vllm_pull.py``'s mirrored
rows and on its own.

Two measures, each against the same work without the mirror, in the same run:

- ``timed_write``: ``KVCache.write`` of one chunk's tokens over every layer without the
  mirror, the mirror's own writes (``KVMirror.write``, what ``KVCache.write`` adds while
  ``mirroring``), and the two together: the mirror's writes are what the forward grows by
  (the pull rows count the last chunk's in the pull path: nothing hides it);
- ``forward_rows``: a real ``Runner`` forward of a small random Llama with the KV shape of
  Llama-3-8B (32 layers, 8 KV heads of 128, bf16) and a narrow body (hidden 256, 8 query
  heads), with and without every token mirrored: the runner's speed with the mirror against
  without. A real 8B forward is ~100x this one's FLOPs per token for the same KV writes, so
  its ratio is closer to 1 than this one's.

    python bench/kv_mirror.py [--repeats 5] [--tokens 1024,2048]

One JSON line per prompt length::

    {"name": "kv_mirror_forward", "tokens", "forward_ms", "forward_mirror_ms", "mirror_ratio",
     "write_ms", "mirror_write_ms", "write_mirroring_ms"}

``mirror_ratio`` is ``forward_ms / forward_mirror_ms`` (1.0: the mirror costs nothing);
``write_ms`` the runner's KV writes alone over every layer (``KVCache.write``, no mirror),
``mirror_write_ms`` the mirror's own writes (``KVMirror.write``), ``write_mirroring_ms``
``KVCache.write`` while mirroring: both.
Medians over the repeats, the first of each a warm-up; with and without alternate, so both
see the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.layout import LAYER_MAJOR
from prefill_worker.model.kv_cache import KVCache, KVMirror, MirrorTargets
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
class WriteTimes:
    pool_s: float  # KVCache.write of every layer, no mirror
    mirror_s: float  # the mirror's own writes of every layer (KVMirror.write)
    both_s: float  # KVCache.write of every layer, mirroring


def timed_write(
    kv: KVCache,
    mirror: KVMirror,
    slots: torch.Tensor,
    mirror_slots: np.ndarray,
    k: torch.Tensor,
    v: torch.Tensor,
) -> WriteTimes:
    """One chunk's ``k/v [T, KV, D]`` into every layer at pool rows ``slots``: without the
    mirror, the mirror's writes alone (``mirror`` is ``kv``'s), then ``KVCache.write``
    mirroring (which leaves the mirror written). The mirror's share of a forward is its own
    writes: on a loaded host the pool's OpenMP writes swing by 10x between two calls, so
    ``both_s - pool_s`` is mostly that noise."""
    layers = range(kv.layout.num_layers)
    start = time.perf_counter()
    for layer in layers:
        kv.write(layer, slots, k, v)
    pool_s = time.perf_counter() - start
    start = time.perf_counter()
    index = mirror.index_of(mirror_slots)
    for layer in layers:
        mirror.write(layer, index, k, v)
    mirror_s = time.perf_counter() - start
    start = time.perf_counter()
    with kv.mirroring(MirrorTargets(None, mirror_slots)):
        for layer in layers:
            kv.write(layer, slots, k, v)
    return WriteTimes(pool_s, mirror_s, time.perf_counter() - start)


def paired_blocks(kv: KVCache, num_blocks: int) -> list[np.ndarray]:
    """A zeroed staging region in vLLM's layout for ``kv``'s shape (untouched, as the
    worker's: the warm-up repeat takes its page faults)."""
    lay = kv.layout
    shape = (num_blocks, lay.num_kv_heads, BLOCK_SIZE, 2 * lay.head_dim)
    return [np.zeros(shape, np.uint16) for _ in range(lay.num_layers)]


def forward_rows(tokens: int, repeats: int) -> dict[str, Any]:
    """The runner's forward of one ``tokens``-token prompt, with and without the mirror."""
    torch.manual_seed(0)
    num_pages = tokens // PAGE_SIZE
    cpu = torch.device("cpu")
    runner, spec = random_runner(
        NARROW_8B_KV, torch.bfloat16, cpu, "sdpa", PAGE_SIZE, num_pages, 0, LAYER_MAJOR
    )
    mirror = KVMirror(paired_blocks(runner.kv_cache, tokens // BLOCK_SIZE), torch.bfloat16)
    runner.kv_cache.attach_mirror(mirror)
    ids = torch.randint(0, spec.vocab_size, (tokens,)).tolist()
    greedy = SamplingParams(temperature=0.0)
    pages = list(np.random.default_rng(0).permutation(num_pages))
    slots = list(range(tokens))
    plain = BatchPlan(1, (ChunkPlan("p", ids, 0, tokens, pages, greedy),))
    mirrored = BatchPlan(1, (ChunkPlan("p", ids, 0, tokens, pages, greedy, mirror_slots=slots),))
    times: dict[str, list[float]] = {"plain": [], "mirror": []}
    for _ in range(repeats + 1):
        for name, plan in (("plain", plain), ("mirror", mirrored)):
            start = time.perf_counter()
            runner.run(plan)
            times[name].append(time.perf_counter() - start)
    writes = [_write_once(runner.kv_cache, mirror, tokens) for _ in range(repeats + 1)]
    forward, forward_mirror = (statistics.median(times[n][1:]) for n in ("plain", "mirror"))
    return {
        "name": "kv_mirror_forward",
        "tokens": tokens,
        "forward_ms": round(forward * 1e3, 2),
        "forward_mirror_ms": round(forward_mirror * 1e3, 2),
        "mirror_ratio": round(forward / forward_mirror, 3),
        "write_ms": _median_ms(w.pool_s for w in writes[1:]),
        "mirror_write_ms": _median_ms(w.mirror_s for w in writes[1:]),
        "write_mirroring_ms": _median_ms(w.both_s for w in writes[1:]),
    }


def _median_ms(seconds: Iterable[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


def _write_once(kv: KVCache, mirror: KVMirror, tokens: int) -> WriteTimes:
    lay = kv.layout
    k = torch.randn(tokens, lay.num_kv_heads, lay.head_dim).to(torch.bfloat16)
    slots = torch.randperm(lay.num_pages * lay.page_size)[:tokens]
    return timed_write(kv, mirror, slots, np.arange(tokens), k, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", default="1024,2048")
    args = parser.parse_args()
    for tokens in (int(t) for t in args.tokens.split(",")):
        print(json.dumps(forward_rows(tokens, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
