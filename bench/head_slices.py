"""What writing KV across different prefill and decode TP sizes costs in NIXL descriptors, and
in time over real NIXL (UCX, in this process), against the same pages at equal TP.

A Llama-3-8B-shaped pool (8 KV heads, head_dim 128, bf16, page size 16) and a 2048-token
prompt (128 pages). Counts are for all 32 layers (``transfer.headplan.num_descriptors``);
the timed writes use ``--layers`` layers (default 4, so both sides' pools fit a shared
machine) through ``transfer.nixl.rank_writer`` (one agent per rank), every rank's writes
posted then polled to DONE, the median of ``--repeats``. One JSON line per (p, d)::

    {"name": "head_slices", "kv_heads", "p", "d", "is_sliced", "descriptors_per_rank",
     "descriptors_total", "bytes_per_descriptor", "write_ms", "same_tp_write_ms", "ratio"}

``descriptors_per_rank``: the most any prefill rank posts; ``is_sliced``: pages go as token
runs (``page_size`` per page and layer-plane) rather than whole; ``ratio``: write_ms over the
same bytes written at p = d = 1 (whole pages), in the same run.

    python bench/head_slices.py [--repeats 5] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.headplan import num_descriptors, plan_group, plan_rank
from prefill_worker.transfer.nixl.agent import make_agent, register_regions
from prefill_worker.transfer.nixl.rank_writer import RankPlace, RankWriter

KV_HEADS, HEAD_DIM, PAGE_SIZE, FULL_LAYERS, TOKENS = 8, 128, 16, 32, 2048
CASES = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (8, 8))
NUM_PAGES = TOKENS // PAGE_SIZE


class _Rank:
    def __init__(self, name: str, num_heads: int, num_layers: int) -> None:
        self.layout = KVLayout(num_layers, num_heads, HEAD_DIM, "bfloat16", PAGE_SIZE, NUM_PAGES)
        self.buf = np.ones(self.layout.pool_bytes + AUX_ROW_BYTES, dtype=np.uint8)
        base = int(self.buf.ctypes.data)
        rb = self.layout.region_bytes
        k = tuple(base + i * rb for i in range(num_layers))
        v = tuple(base + (num_layers + i) * rb for i in range(num_layers))
        self.regions = KVRegions(self.layout, k, v, "cpu", base + self.layout.pool_bytes, 1)
        self.agent = make_agent(name, ["UCX"])
        register_regions(self.agent, self.regions)


def _timed_write(p: int, d: int, num_layers: int, repeats: int, tag: str) -> float:
    decode = [
        _Rank(f"{tag}-d{j}", len(kv_head_range(KV_HEADS, j, d)), num_layers) for j in range(d)
    ]
    writers: list[tuple[Any, RankWriter, list[str]]] = []
    for r in range(p):
        place = RankPlace(r, p, KV_HEADS)
        rank = _Rank(f"{tag}-p{r}", len(place.heads), num_layers)
        writer = RankWriter(rank.agent, place, rank.regions)
        names = [
            writer.add_peer(x.agent.get_agent_metadata(), x.regions, j, d)
            for j, x in enumerate(decode)
        ]
        writers.append((rank.agent, writer, [n for n in names if n is not None]))
    pages = np.random.default_rng(0).permutation(NUM_PAGES)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        handles = [
            (agent, writer.post(name, pages, pages, b""))
            for agent, writer, names in writers
            for name in names
        ]
        while not all(agent.check_xfer_state(h) == "DONE" for agent, h in handles):
            for x in decode:
                x.agent.get_new_notifs()
        times.append((time.perf_counter() - start) * 1e3)
        for agent, h in handles:
            agent.release_xfer_handle(h)
    for _, writer, _ in writers:
        writer.close()
    return statistics.median(times[1:])


def _case(p: int, d: int, num_layers: int, repeats: int, same_tp_ms: float) -> dict[str, Any]:
    per_rank = [
        sum(
            num_descriptors(s, FULL_LAYERS, PAGE_SIZE, NUM_PAGES)
            for s in plan_rank(KV_HEADS, r, p, d)
        )
        for r in range(p)
    ]
    slices = plan_group(KV_HEADS, p, d)
    write_ms = _timed_write(p, d, num_layers, repeats, f"hs{p}{d}")
    return {
        "name": "head_slices",
        "kv_heads": KV_HEADS,
        "p": p,
        "d": d,
        "is_sliced": not all(s.is_whole_page for s in slices),
        "descriptors_per_rank": max(per_rank),
        "descriptors_total": sum(per_rank),
        "bytes_per_descriptor": min(
            s.num_heads * HEAD_DIM * 2 * (1 if not s.is_whole_page else PAGE_SIZE) for s in slices
        ),
        "write_ms": round(write_ms, 2),
        "same_tp_write_ms": round(same_tp_ms, 2),
        "ratio": round(write_ms / same_tp_ms, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    same_tp_ms = _timed_write(1, 1, args.layers, args.repeats, "ref")
    for p, d in CASES:
        print(json.dumps(_case(p, d, args.layers, args.repeats, same_tp_ms)), flush=True)


if __name__ == "__main__":
    main()
