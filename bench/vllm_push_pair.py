"""vLLM push against the native push, interleaved (``bench/transfer_bandwidth.py --protocol
push,vllm-push --interleave``): one native thread push (to scattered decode pages) and one
vLLM push (``bench/vllm_push.py``'s ``Rig``: the staging region, or with a vllm_blocks pool
the pool's own pages, ``"source": "pool"``, WRITten into scattered decode blocks on the
decode's registration) of the same bytes, one right after the other,
``repeats`` times (who goes first alternates; the first pair is a warm-up), so that both
see the same machine load. Both decodes and both worker backends live for the whole run.
One row per protocol and prompt length, medians over the repeats, and on the vLLM row the
median of the per-pair ratios (``pair_ratio_median``: each pair measured seconds apart,
what a loaded machine leaves comparable). The native time runs from its first chunk's
hand-over to the worker seeing its status written, the vLLM time from the decode sending its
registration to the decode holding the notification (what a push decode waits for, the
registration's and the notification's trips included); ``worker_pair_ratio_median`` pairs
the native time with the vLLM WRITE's own span on the worker (posted to seen settled), the
same span as the native one::

    {"name": "transfer", "protocol": "push" | "vllm-push", "interleaved": true,
     "pool_layout", "tokens", "layout": "scattered", "gb_s", "memcpy_gb_s", "repeats",
     "load_avg", ...; vllm-push: "native_push_gb_s", "vllm_push_vs_native",
     "pair_ratio_median", "pair_ratios", "worker_pair_ratio_median", "write_ms",
     "registered_to_notified_ms",
     "descriptors", "descriptor_bytes"}
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys

import numpy as np
import transfer_bandwidth as tb
import vllm_push

from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.layout import VLLM_BLOCKS


def _tree() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_pair(pool_layout: str, repeats: int, chunk_pages: int) -> None:
    from prefill_worker.transfer import make_backend
    from prefill_worker.transfer.options import NativeOptions

    lay = tb.layout(tb.NUM_LOCAL_PAGES, pool_layout)
    pool = np.random.default_rng(0).integers(0, 256, lay.pool_bytes, np.uint8)
    aux = AuxPool(16)
    row = aux.try_alloc()
    assert row == 0
    aux.write(row, AuxRow(1, 0.0, 8192, 0))
    regions = tb.regions_over(lay, pool, aux)
    backend = make_backend(regions, NativeOptions("tcp://127.0.0.1:0", 30.0, 0.2, push_thread=True))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=tb.decode_main,
        args=(child, backend.bootstrap_endpoint, pool_layout, "bfloat16"),
        daemon=True,
    )
    proc.start()
    while not conn.poll(0.001):
        backend.poll()
    assert conn.recv() == "registered"
    rig = vllm_push.Rig(regions, direct=pool_layout == VLLM_BLOCKS)
    rng = np.random.default_rng(1)
    decode_pages = tb.layout(tb.NUM_DECODE_PAGES, pool_layout).num_pages
    copy_dst = np.ones(2 * lay.num_layers * decode_pages * lay.page_bytes, np.uint8)
    chunk_pages = chunk_pages * tb.PAGE_SIZE // lay.page_size  # the same tokens per chunk
    room = 1
    common = {"interleaved": True, "command": " ".join(["python", *sys.argv]), "tree": _tree()}
    try:
        for tokens in vllm_push.TOKENS:
            n = tokens // lay.page_size
            nbytes = n * lay.page_bytes * 2 * lay.num_layers
            native, vllm, writes, copies, loads = [], [], [], [], []
            for i in range(repeats + 1):
                for which in ("native", "vllm") if i % 2 == 0 else ("vllm", "native"):
                    if which == "native":
                        src = tb.scattered(rng, lay.num_pages, n)
                        dst = tb.scattered(rng, decode_pages, n)
                        room += 1
                        args = (backend, conn, room, src, dst, chunk_pages, lay.page_size)
                        native.append(tb.push_once(*args)[0])
                    else:
                        elapsed, write_s = rig.once(tokens)
                        vllm.append(elapsed)
                        writes.append(write_s)
                copies.append(tb.memcpy_s(pool, copy_dst, nbytes))
                loads.append(os.getloadavg()[0])
            ratios = [n_s / v_s for n_s, v_s in zip(native[1:], vllm[1:], strict=True)]
            # the same span on both sides: posted to seen settled on the worker
            worker = [n_s / w_s for n_s, w_s in zip(native[1:], writes[1:], strict=True)]
            native_gb_s = nbytes / statistics.median(native[1:]) / 1e9
            vllm_gb_s = nbytes / statistics.median(vllm[1:]) / 1e9
            shared = {
                "pool_layout": pool_layout,
                "tokens": tokens,
                "layout": "scattered",
                "memcpy_gb_s": round(nbytes / statistics.median(copies[1:]) / 1e9, 3),
                "repeats": repeats,
                "load_avg": round(statistics.median(loads[1:]), 2),
                **common,
            }
            print(json.dumps({"name": "transfer", "protocol": "push", "push": "thread",
                              "gb_s": round(native_gb_s, 3), **shared}), flush=True)  # fmt: skip
            print(
                json.dumps(
                    {
                        "name": "transfer",
                        "protocol": "vllm-push",
                        "source": rig.source,
                        "gb_s": round(vllm_gb_s, 3),
                        "native_push_gb_s": round(native_gb_s, 3),
                        "vllm_push_vs_native": round(vllm_gb_s / native_gb_s, 3),
                        "pair_ratio_median": round(statistics.median(ratios), 3),
                        "pair_ratios": [round(r, 3) for r in ratios],
                        "worker_pair_ratio_median": round(statistics.median(worker), 3),
                        "write_ms": round(statistics.median(writes[1:]) * 1e3, 3),
                        "registered_to_notified_ms": round(statistics.median(vllm[1:]) * 1e3, 3),
                        "descriptors": rig.layout.num_layers * tokens // vllm_push.BLOCK_SIZE,
                        "descriptor_bytes": rig.layout.block_bytes,
                        **shared,
                    }
                ),
                flush=True,
            )
    finally:
        rig.close()
        conn.send(("exit",))
        proc.join(10)
        backend.close()
