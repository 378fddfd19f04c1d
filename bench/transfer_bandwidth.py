"""KV push bandwidth over real NIXL to a decode process, against an in-process memcpy.

A Llama-3-8B-shaped KV pool (32 layers, 8 KV heads, head_dim 128, bf16, page size 16: 32 KiB
per page of one layer's K or V) in both pool layouts (``kv.layout``: layer-major, where a
page is 64 descriptors of 32 KiB; page-major, where it is one of 2 MiB), for 1k and 8k
tokens, pushed in chunks (2048 tokens by default) to a KVReceiver in a spawned process, with
contiguous and fully scattered page maps (no two consecutive pages adjacent on either side).
The reference is a memcpy of the same number of bytes in this process, in the same run: one
copy between touched buffers right after each push, so both see the same machine load, and
both reported as the median over the repeats (the first push and copy are a warm-up). One
JSON line per case::

    {"name": "transfer", "pool_layout", "push", "tokens", "layout", "gb_s", "memcpy_gb_s",
     "ratio", "prep_ms", "prep_cpu_ms", "engine_max_call_ms"}

``layout`` is the page map (contiguous or scattered); ``push`` where writes are posted
(``thread``: the worker's transfer thread; ``inline``: on the engine thread, as before #17).
``prep_ms`` is the per-request time spent building descriptor indices and NIXL transfer
requests (all chunks, wherever they run); ``prep_cpu_ms`` the same in CPU time of the threads
that did it (on a loaded machine wall time adds the waits for a core and for the GIL).
``engine_max_call_ms`` is the longest single call the engine thread made into the backend
during the push (``send_pages``, ``send_aux``, ``poll``): what a push can stall the engine
loop by. Goals: ratio >= 0.8 contiguous; page-major >= 0.8 scattered and prep_ms <= 0.2 at
8k (layer-major: >= 0.5 and <= 1).

Scattered lines add ``scattered_memcpy_gb_s`` and ``scattered_ratio``: the same pages as each
push copied in this process piece by piece (one memmove per descriptor: 32 KiB layer-major,
2 MiB page-major; Python's per-call overhead, well under a microsecond, is included). That is
what the memory system gives for such pieces at random places, the ceiling for any transport;
on the 2-core development VM (THP-backed pools) it measured 0.5-0.75 of the contiguous memcpy
for 32 KiB pieces. With UCX over cma every piece is one process_vm_writev of one remote iovec.

``--kv-dtypes bfloat16,fp8_e4m3`` adds the same pool in FP8 (``cache.kv_dtype: fp8_e4m3``: one
byte per value, 16 KiB per page of one layer's K or V); every push row names its ``kv_dtype``
and the ``bytes_per_token`` it moved (all layers' K and V), so an FP8 row's bytes are half a
bf16 row's.

    python bench/transfer_bandwidth.py [--repeats 5] [--pool-layouts layer_major,page_major]
                                       [--push thread,inline] [--protocol push,vllm]
                                       [--paired-push after|before]

``--protocol vllm-push`` adds the vLLM-push rows (``"protocol": "vllm-push"``: the worker
WRITEs staged blocks into a push decode's blocks on its registration, ``bench/vllm_push.py``),
with ``push,vllm-push`` beside the native push's scattered rows (``vllm_push_vs_native``).
``--protocol push,vllm-push --interleave`` runs the two pushes alternately, request by
request, instead (``bench/vllm_push_pair.py``: the native scattered thread push and the vLLM
push, medians and the median of per-pair ratios), what a loaded machine leaves comparable.
With ``--pool-layouts vllm_blocks`` the pool is vLLM's blocks (pages of 32 tokens): the
vLLM push WRITEs the pool's pages themselves (``"source": "pool"``, no staging region) and
the native push sends the same pool into a native decode pool of the same layout.

``--protocol vllm`` adds the vLLM-pull rows (``"protocol": "vllm"``: the request staged in
vLLM's layout by the repack, ``"staging": "repack"``, and by the forward's KV mirror,
``"staging": "mirror"``, then a decode's READ of it, against the same memcpy, and with
``push,vllm`` the pull path's bandwidth against the thread push's scattered rows; the mirror
rows also against a push of the same pages right after each READ, ``paired_push_gb_s``;
``bench/vllm_pull.py``), then one row of the runner's forward with and without the mirror
(``bench/kv_mirror.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.layout import (
    LAYER_MAJOR,
    PAGE_MAJOR,
    POOL_LAYOUTS,
    VLLM_BLOCKS,
    KVLayout,
    KVRegions,
)

PAGE_SIZE = 16
NUM_LOCAL_PAGES = 8192 // PAGE_SIZE
NUM_DECODE_PAGES = NUM_LOCAL_PAGES + NUM_LOCAL_PAGES // 4


VLLM_PAGE_SIZE = 32  # a vllm_blocks pool's page: one vLLM block (the vLLM rows' block size)


def layout(num_pages: int, pool_layout: str, kv_dtype: str = "bfloat16") -> KVLayout:
    """``num_pages`` pages of ``PAGE_SIZE`` tokens' worth: a vllm_blocks pool holds the same
    tokens in pages of ``VLLM_PAGE_SIZE``."""
    page_size = VLLM_PAGE_SIZE if pool_layout == VLLM_BLOCKS else PAGE_SIZE
    count = num_pages * PAGE_SIZE // page_size
    return KVLayout(32, 8, 128, kv_dtype, page_size, count, pool_layout)


def regions_over(lay: KVLayout, buf: np.ndarray, aux: AuxPool) -> KVRegions:
    """The pool at the start of ``buf``: K of each layer, then V of each layer (layer-major),
    page after page of every layer's K and V (page-major), or each layer's K‖V blocks
    (vllm_blocks: V one head_dim after K)."""
    base = int(buf.ctypes.data)
    if lay.kind == VLLM_BLOCKS:
        k = tuple(base + i * lay.region_bytes for i in range(lay.num_layers))
        v = tuple(a + lay.head_dim * lay.itemsize for a in k)
    elif lay.kind == LAYER_MAJOR:
        starts = [base + i * lay.region_bytes for i in range(2 * lay.num_layers)]
        k, v = tuple(starts[: lay.num_layers]), tuple(starts[lay.num_layers :])
    else:
        k = tuple(base + 2 * i * lay.page_bytes for i in range(lay.num_layers))
        v = tuple(a + lay.page_bytes for a in k)
    return KVRegions(lay, k, v, "cpu", aux.base_addr, aux.num_rows)


def decode_main(conn: Connection, addr: str, pool_layout: str, kv_dtype: str) -> None:
    from prefill_worker.transfer import KVReceiver, RoomState

    lay = layout(NUM_DECODE_PAGES, pool_layout, kv_dtype)
    pool = np.ones(lay.pool_bytes, np.uint8)  # touched: no page faults
    aux = AuxPool(16)
    receiver = KVReceiver(regions_over(lay, pool, aux), addr, heartbeat_interval_s=0.2)
    receiver.wait_registered(30.0)
    conn.send("registered")
    while True:
        receiver.progress()
        if not conn.poll(0.0005):
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "want":
            receiver.want(*args)
            conn.send("ok")
        elif cmd == "wait":
            while receiver.poll(args[0]).state is RoomState.PENDING:
                receiver.progress()
            status = receiver.poll(args[0])
            why = "" if status.reason is None else f": {status.reason}"
            conn.send(status.state.value + why)
            receiver.forget(args[0])
    receiver.close()


def scattered(rng: np.random.Generator, pool_pages: int, n: int) -> list[int]:
    """n distinct pages of the pool, no two consecutive entries adjacent in memory."""
    while True:
        pages = rng.choice(pool_pages, n, replace=False)
        if not np.any(np.abs(np.diff(pages)) == 1):
            return [int(p) for p in pages]


def memcpy_s(src: np.ndarray, dst: np.ndarray, nbytes: int) -> float:
    start = time.perf_counter()
    np.copyto(dst[:nbytes], src[:nbytes])
    return time.perf_counter() - start


def scattered_memcpy_s(
    lay: KVLayout, src: np.ndarray, dst: np.ndarray, src_pages: list[int], dst_pages: list[int]
) -> float:
    """Seconds to copy K and V of ``src_pages`` of every layer to ``dst_pages``, one memmove
    per descriptor the layout makes (a layer's page, or a whole page)."""
    regions = np.arange(lay.num_regions, dtype=np.int64)[:, None]
    pool_page_bytes = 2 * lay.num_layers * lay.page_bytes  # every region's share of a page
    src_pool_pages, dst_pool_pages = src.size // pool_page_bytes, dst.size // pool_page_bytes
    unit = lay.region_page_bytes
    s = src.ctypes.data + (regions * src_pool_pages + np.asarray(src_pages)) * unit
    d = dst.ctypes.data + (regions * dst_pool_pages + np.asarray(dst_pages)) * unit
    pairs = list(zip(s.ravel().tolist(), d.ravel().tolist(), strict=True))
    page_bytes, memmove = unit, ctypes.memmove
    start = time.perf_counter()
    for src_addr, dst_addr in pairs:
        memmove(dst_addr, src_addr, page_bytes)
    return time.perf_counter() - start


class _Timed:
    """The longest single call made through ``call``."""

    def __init__(self) -> None:
        self.max_s = 0.0

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        fn(*args)
        self.max_s = max(self.max_s, time.perf_counter() - start)


def push_once(
    backend,
    conn: Connection,
    room: int,
    src: list[int],
    dst: list[int],
    chunk_pages: int,
    page_size: int = PAGE_SIZE,
) -> tuple[float, tuple[float, float], float]:
    """(seconds from first chunk to status ok, (prep seconds, prep CPU seconds), longest
    engine-thread call) for one request."""
    from prefill_worker.transfer.base import KVPoll

    conn.send(("want", room, dst, 0, 0))
    assert conn.recv() == "ok"
    sender = backend.create_sender(room, f"bench-{room}", len(src) * page_size)
    while sender.poll() is not KVPoll.READY:
        backend.poll()
        assert not sender.poll().is_terminal, sender.failure_reason()
    timed = _Timed()
    start = time.perf_counter()
    for first in range(0, len(src), chunk_pages):
        timed.call(sender.send_pages, src[first : first + chunk_pages], first)
        timed.call(backend.poll)
    timed.call(sender.send_aux, 0)
    while not sender.poll().is_terminal:
        backend.wait(0.01)  # as the engine does when a turn found nothing to do
        timed.call(backend.poll)
    elapsed = time.perf_counter() - start
    assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
    conn.send(("wait", room))
    while not conn.poll(0.001):  # the decode's answer waits on our NIXL notification: progress
        backend.poll()
    state = conn.recv()
    assert state == "done", f"room {room}: {state}"
    prep_s = (sender.prep_s, sender.prep_cpu_s)
    sender.close()
    return elapsed, prep_s, timed.max_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="prompt tokens per chunk")
    parser.add_argument(
        "--pool-layouts",
        default=",".join((LAYER_MAJOR, PAGE_MAJOR)),
        help=f"of {', '.join(POOL_LAYOUTS)}; {VLLM_BLOCKS} with --interleave only",
    )
    parser.add_argument(
        "--push", default="thread", help="thread (the worker's) or inline (before #17), or both"
    )
    parser.add_argument("--kv-dtypes", default="bfloat16", help="bfloat16, fp8_e4m3, or both")
    parser.add_argument(
        "--protocol",
        default="push",
        help="any of push, vllm (pull rows), vllm-push, comma-separated",
    )
    parser.add_argument(
        "--paired-push",
        default="after",
        choices=("after", "before"),
        help="the vLLM mirror rows' paired push: after their READs, or before (bench/vllm_pull.py)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="with push,vllm-push: the two pushes alternately (bench/vllm_push_pair.py)",
    )
    args = parser.parse_args()
    protocols = args.protocol.split(",")
    chunk_pages = args.chunk_tokens // PAGE_SIZE
    if args.interleave:
        import vllm_push_pair

        assert set(protocols) == {"push", "vllm-push"}, "--interleave: --protocol push,vllm-push"
        for pool_layout in args.pool_layouts.split(","):
            vllm_push_pair.run_pair(pool_layout, args.repeats, chunk_pages)
        return
    for pool_layout in args.pool_layouts.split(","):
        push_gb_s: dict[int, float] = {}  # the thread push's scattered rows, by tokens
        for push in args.push.split(",") if "push" in protocols else ():
            for kv_dtype in args.kv_dtypes.split(","):
                rows = run_layout(pool_layout, push, args.repeats, chunk_pages, kv_dtype)
                if push == "thread" and kv_dtype == "bfloat16":
                    push_gb_s = rows
        if "vllm" in protocols:
            run_vllm(pool_layout, args.repeats, chunk_pages, push_gb_s, args.paired_push)
        if "vllm-push" in protocols:
            run_vllm_push(pool_layout, args.repeats, push_gb_s)
    if "vllm" in protocols:  # the runner's speed with the mirror against without
        import kv_mirror

        print(json.dumps(kv_mirror.forward_rows(1024, args.repeats)), flush=True)


def run_vllm(
    pool_layout: str,
    repeats: int,
    chunk_pages: int,
    push_gb_s: dict[int, float],
    paired_push: str = "after",
) -> None:
    """The vLLM-pull rows (``bench/vllm_pull.py``) over the same pool shape, in the pool of a
    runner whose forwards stage the mirrored rows (``bench/kv_mirror.py``'s narrow model with
    the same KV shape: its forwards, and the mirror's copies, are part of those rows)."""
    import kv_mirror
    import vllm_pull

    runner = kv_mirror.narrow_runner(NUM_LOCAL_PAGES, pool_layout)
    assert runner.kv_cache.layout == layout(NUM_LOCAL_PAGES, pool_layout)
    for plane in (*runner.kv_cache.k, *runner.kv_cache.v):
        plane.normal_()  # touched, as the push rows' pools
    vllm_pull.run(runner, repeats, chunk_pages, push_gb_s, paired_push)


def run_vllm_push(pool_layout: str, repeats: int, push_gb_s: dict[int, float]) -> None:
    """The vLLM-push rows (``bench/vllm_push.py``) over the same pool shape."""
    import vllm_push

    lay = layout(NUM_LOCAL_PAGES, pool_layout)
    pool = np.random.default_rng(0).integers(0, 256, lay.pool_bytes, np.uint8)
    aux = AuxPool(16)
    vllm_push.run(regions_over(lay, pool, aux), pool_layout, repeats, push_gb_s, pool)


def run_layout(
    pool_layout: str, push: str, repeats: int, chunk_pages: int, kv_dtype: str = "bfloat16"
) -> dict[int, float]:
    """Every case for one pool layout and KV dtype, against a fresh worker and decode; the
    scattered rows' GB/s by prompt length."""
    from prefill_worker.transfer import make_backend
    from prefill_worker.transfer.options import NativeOptions

    lay = layout(NUM_LOCAL_PAGES, pool_layout, kv_dtype)
    pool = np.random.default_rng(0).integers(0, 256, lay.pool_bytes, np.uint8)
    aux = AuxPool(16)
    row = aux.try_alloc()
    assert row == 0
    aux.write(row, AuxRow(1, 0.0, 8192, 0))
    backend = make_backend(
        regions_over(lay, pool, aux),
        NativeOptions("tcp://127.0.0.1:0", 30.0, 0.2, push_thread=push == "thread"),
    )
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    args = (child, backend.bootstrap_endpoint, pool_layout, kv_dtype)
    proc = ctx.Process(target=decode_main, args=args, daemon=True)
    proc.start()
    while not conn.poll(0.001):
        backend.poll()
    assert conn.recv() == "registered"
    rng = np.random.default_rng(1)
    room = 1
    # stands in for the decode pool (same page count), touched like a live one
    copy_dst = np.ones(2 * lay.num_layers * NUM_DECODE_PAGES * lay.page_bytes, np.uint8)
    scattered_gb_s: dict[int, float] = {}
    try:
        for tokens in (1024, 8192):
            n = tokens // PAGE_SIZE
            nbytes = n * lay.page_bytes * 2 * lay.num_layers
            for kind in ("contiguous", "scattered"):
                times, preps, calls, copies, scattered_copies = [], [], [], [], []
                for _ in range(repeats + 1):  # the first is a warm-up
                    if kind == "contiguous":
                        src, dst = list(range(n)), list(range(7, 7 + n))
                    else:
                        src = scattered(rng, NUM_LOCAL_PAGES, n)
                        dst = scattered(rng, NUM_DECODE_PAGES, n)
                    room += 1
                    elapsed, prep_s, call_s = push_once(backend, conn, room, src, dst, chunk_pages)
                    times.append(elapsed)
                    preps.append(prep_s)
                    calls.append(call_s)
                    copies.append(memcpy_s(pool, copy_dst, nbytes))
                    if kind == "scattered":
                        scattered_copies.append(scattered_memcpy_s(lay, pool, copy_dst, src, dst))
                gb_s = nbytes / statistics.median(times[1:]) / 1e9
                ref = nbytes / statistics.median(copies[1:]) / 1e9
                line = {
                    "name": "transfer",
                    "pool_layout": pool_layout,
                    "kv_dtype": kv_dtype,
                    "bytes_per_token": nbytes // tokens,
                    "push": push,
                    "tokens": tokens,
                    "layout": kind,
                    "gb_s": round(gb_s, 3),
                    "memcpy_gb_s": round(ref, 3),
                    "ratio": round(gb_s / ref, 3),
                    "prep_ms": round(statistics.median(p[0] for p in preps[1:]) * 1e3, 3),
                    "prep_cpu_ms": round(statistics.median(p[1] for p in preps[1:]) * 1e3, 3),
                    "engine_max_call_ms": round(max(calls[1:]) * 1e3, 3),
                }
                if scattered_copies:
                    scattered_gb_s[tokens] = line["gb_s"]
                    scattered_ref = nbytes / statistics.median(scattered_copies[1:]) / 1e9
                    line["scattered_memcpy_gb_s"] = round(scattered_ref, 3)
                    line["scattered_ratio"] = round(gb_s / scattered_ref, 3)
                print(json.dumps(line), flush=True)
    finally:
        conn.send(("exit",))
        proc.join(10)
        backend.close()
    return scattered_gb_s


if __name__ == "__main__":
    main()
