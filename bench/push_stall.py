"""Where a NIXL write's copy runs: how long the thread that posts it is stalled, three ways.

The question behind ``nixl.push_thread`` (issue 17): over UCX on one host (cma) a WRITE is
copied inside ``postXferReq``. Does NIXL's own progress thread (``enable_prog_thread``) move
the copy off the caller, or must a thread of ours post it? A decode process registers an
8B-shaped pool (32 layers, 8 KV heads, head_dim 128, bf16, page size 16); this process
writes one 2048-token chunk (128 scattered pages, 256 MiB) into it, repeatedly, three ways:

    inline             progress thread off, posted on the measuring thread (main before #17)
    ucx_progress       NIXL's progress thread on, posted on the measuring thread
    transfer_thread    ``PushThread`` owns the agent; the measuring thread only queues

and reports, per way, the median and worst time the measuring thread spent inside the call
that posts (``post_ms``), the time until the write was DONE (``done_ms``), and the longest gap
between iterations of a busy Python loop on the measuring thread while the write ran
(``loop_gap_ms``: what an engine loop would feel, GIL included). One JSON line per way::

    {"name": "push_stall", "pool_layout", "mode", "post_ms", "post_max_ms", "done_ms",
     "loop_gap_ms"}

    python bench/push_stall.py [--repeats 5] [--pool-layout page_major]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bandwidth import NUM_DECODE_PAGES, NUM_LOCAL_PAGES, layout, regions_over

from prefill_worker.kv.aux import AuxPool

CHUNK_PAGES = 2048 // 16


def decode_main(conn: Connection, pool_layout: str) -> None:
    """Registers a pool, hands its metadata over, progresses until told to stop."""
    from prefill_worker.transfer.nixl.agent import make_agent, register_regions

    lay = layout(NUM_DECODE_PAGES, pool_layout)
    pool = np.ones(lay.pool_bytes, np.uint8)
    aux = AuxPool(4)
    agent = make_agent("push-stall-decode", ["UCX"])
    register_regions(agent, regions_over(lay, pool, aux))
    conn.send((agent.get_agent_metadata(), regions_over(lay, pool, aux)))
    while not conn.poll(0.001):
        agent.get_new_notifs()


def agent_for(mode: str):  # type: ignore[no-untyped-def]
    from prefill_worker.transfer.nixl.agent import nixl_agent, nixl_agent_config

    config = nixl_agent_config(
        enable_prog_thread=mode == "ucx_progress", enable_listen_thread=False, backends=["UCX"]
    )
    return nixl_agent(f"push-stall-{mode}", config)


def busy_until(is_done) -> float:  # type: ignore[no-untyped-def]
    """Loop like an engine with work to do until ``is_done()``; the longest gap (s)."""
    longest, last = 0.0, time.perf_counter()
    while not is_done():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


def measure(mode: str, pool_layout: str, remote, repeats: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from prefill_worker.transfer.nixl.agent import prep_lists, register_regions
    from prefill_worker.transfer.nixl.push_thread import PushThread
    from prefill_worker.transfer.pagemap import region_indices

    metadata, remote_regions = remote
    lay = layout(NUM_LOCAL_PAGES, pool_layout)
    pool = np.random.default_rng(0).integers(0, 256, lay.pool_bytes, np.uint8)
    aux = AuxPool(4)
    agent = agent_for(mode)
    regions = regions_over(lay, pool, aux)
    register_regions(agent, regions)
    name = agent.add_remote_agent(metadata)
    ours = prep_lists(agent, "NIXL_INIT_AGENT", regions)
    theirs = prep_lists(agent, name.decode() if isinstance(name, bytes) else name, remote_regions)
    thread = PushThread(agent) if mode == "transfer_thread" else None
    rng = np.random.default_rng(1)
    posts, dones, gaps = [], [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        src = rng.choice(NUM_LOCAL_PAGES, CHUNK_PAGES, replace=False)
        dst = rng.choice(NUM_DECODE_PAGES, CHUNK_PAGES, replace=False)
        local = region_indices(src, lay.num_regions, lay.num_pages)
        far = region_indices(dst, lay.num_regions, remote_regions.layout.num_pages)
        start = time.perf_counter()
        if thread is None:
            handle = agent.make_prepped_xfer("WRITE", ours.kv, local, theirs.kv, far, b"")
            agent.transfer(handle)
            posts.append(time.perf_counter() - start)
            while agent.check_xfer_state(handle) == "PROC":
                pass
            dones.append(time.perf_counter() - start)
            handle.release()
            gaps.append(posts[-1])  # the loop could not run while the caller copied
            continue
        write = thread.post(ours.kv, local, theirs.kv, far, b"", 0)
        posts.append(time.perf_counter() - start)
        gaps.append(busy_until(lambda: write.is_settled))  # noqa: B023
        dones.append(time.perf_counter() - start)
    if thread is not None:
        thread.close()
    return {
        "name": "push_stall",
        "pool_layout": pool_layout,
        "mode": mode,
        "post_ms": round(statistics.median(posts[1:]) * 1e3, 3),
        "post_max_ms": round(max(posts[1:]) * 1e3, 3),
        "done_ms": round(statistics.median(dones[1:]) * 1e3, 3),
        "loop_gap_ms": round(max(gaps[1:]) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool-layout", default="page_major")
    args = parser.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ctx = mp.get_context("spawn")
    for mode in ("inline", "ucx_progress", "transfer_thread"):
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=decode_main, args=(child, args.pool_layout), daemon=True)
        proc.start()
        try:
            remote = conn.recv()
            print(json.dumps(measure(mode, args.pool_layout, remote, args.repeats)), flush=True)
        finally:
            conn.send("exit")
            proc.join(10)


if __name__ == "__main__":
    main()
