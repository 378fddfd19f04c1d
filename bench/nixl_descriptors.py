"""NIXL WRITE speed by descriptor size, nothing of the worker's in the path: one agent in
this process WRITEs 1 GiB (8k tokens of the Llama-3-8B-shaped KV of the transfer rows) into
a decode agent's memory in another process, in descriptors of 32 KiB (a layer-major native
push's: one page of one layer's K or V), 128 KiB (vLLM's: one block of one layer, what the
vLLM push and pull move) and 2 MiB (a page-major native push's: one page of every layer),
the decode's side scattered (no two adjacent), the sizes interleaved repeat by repeat, with
NIXL's progress thread off and on (the vLLM backend's agent runs it). The floor any push of
that descriptor size meets over this transport (UCX cma: one process_vm_writev per
descriptor, inside ``transfer()``). One JSON line per size and progress-thread setting::

    {"name": "nixl_descriptors", "descriptor_bytes", "progress_thread", "descriptors",
     "gb_s", "repeats", "load_avg"}

    python bench/nixl_descriptors.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

TOTAL = 1 << 30
SIZES = (32 << 10, 128 << 10, 2 << 20)


def _agent(name: str, progress: bool):  # type: ignore[no-untyped-def]
    from prefill_worker.transfer.nixl.agent import make_agent

    return make_agent(name, ["UCX"], "lo", progress_thread=progress)


def decode_main(conn: Connection) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    agent = _agent("bench-descriptors-decode", False)
    buf = np.ones(TOTAL * 5 // 4, np.uint8)  # touched
    agent.register_memory(np.array([[buf.ctypes.data, buf.size, 0]], np.uint64), "DRAM")
    conn.send((agent.get_agent_metadata(), int(buf.ctypes.data)))
    while True:
        agent.get_new_notifs()
        if conn.poll(0.0005) and conn.recv() == "exit":
            break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(child,), daemon=True)
    proc.start()
    meta, remote_base = conn.recv()
    src = np.full(TOTAL, 7, np.uint8)
    rng = np.random.default_rng(0)
    preps = {}
    for progress in (False, True):
        agent = _agent(f"bench-descriptors-{int(progress)}", progress)
        table = np.array([[src.ctypes.data, src.size, 0]], np.uint64)
        agent.register_memory(table, "DRAM")
        name = agent.add_remote_agent(meta)
        for size in SIZES:
            n = TOTAL // size
            ours = [(src.ctypes.data + i * size, size, 0) for i in range(n)]
            theirs = [(remote_base + i * size, size, 0) for i in range(n * 5 // 4)]
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(ours, np.uint64), "DRAM")
            remote = agent.prep_xfer_dlist(name, np.array(theirs, np.uint64), "DRAM")
            preps[progress, size] = (agent, local, remote, n)
    times: dict[tuple[bool, int], list[float]] = {key: [] for key in preps}
    loads = []
    for _ in range(repeats + 1):  # the first is a warm-up
        for key, (agent, local, remote, n) in preps.items():
            while True:
                ridx = rng.choice(n * 5 // 4, n, replace=False)
                if not np.any(np.abs(np.diff(ridx)) == 1):
                    break
            start = time.perf_counter()
            handle = agent.make_prepped_xfer(
                "WRITE", local, list(range(n)), remote, ridx.tolist(), b"done"
            )
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            times[key].append(time.perf_counter() - start)
            agent.release_xfer_handle(handle)
            assert state == "DONE"
        loads.append(os.getloadavg()[0])
    for (progress, size), seconds in times.items():
        row = {
            "name": "nixl_descriptors",
            "descriptor_bytes": size,
            "progress_thread": progress,
            "descriptors": TOTAL // size,
            "gb_s": round(TOTAL / statistics.median(seconds[1:]) / 1e9, 3),
            "repeats": repeats,
            "load_avg": round(statistics.median(loads[1:]), 2),
        }
        print(json.dumps(row), flush=True)
    conn.send("exit")
    proc.join(10)


if __name__ == "__main__":
    main()
