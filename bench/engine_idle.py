"""Idle cost of the engine loop: CPU it burns while requests wait for their decode peers.

Prints one JSON line ``{"name": "engine_idle", "num_live", "seconds", "cpu_s", "cpu_fraction",
"wakeups"}``: ``num_live`` prefills sit BOOTSTRAPPING (no decode peer ever sends `want`) on
the real NIXL backend (UCX, bootstrap server on 127.0.0.1) while ``Engine.run`` turns on its
own thread for ``seconds``; ``cpu_s`` is the process's CPU time over that window (the loop
is the only busy thread). Goal: a few percent of one core at most, whatever ``num_live``.

Runs against any tree whose ``scheduler`` exports ``Inbox`` (the loop sleeps on it) or, as on
older trees, takes a plain ``queue.Queue`` (the loop polls it).
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxPool
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.pages import PagePool
from prefill_worker.request import PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from prefill_worker.transfer.native.backend import NixlBackend
from prefill_worker.transfer.options import NativeOptions, NixlOptions

LAYOUT = KVLayout(2, 2, 16, "float32", 16, 64)


class Turns:
    """Counts the loop's turns through the backend's poll."""

    def __init__(self, backend: NixlBackend) -> None:
        self.backend, self.count = backend, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.backend, name)

    def poll(self) -> None:
        self.count += 1
        self.backend.poll()


def make_inbox() -> queue.Queue:
    try:
        from prefill_worker.scheduler import Inbox  # type: ignore[attr-defined]
    except ImportError:
        return queue.Queue()
    return Inbox()


def measure(num_live: int, seconds: float) -> dict:
    aux = AuxPool(8)
    buf = np.zeros(2 * LAYOUT.num_layers * LAYOUT.region_bytes, np.uint8)
    base = int(buf.ctypes.data)
    starts = [base + i * LAYOUT.region_bytes for i in range(2 * LAYOUT.num_layers)]
    regions = KVRegions(LAYOUT, tuple(starts[:2]), tuple(starts[2:]), "cpu", aux.base_addr, 8)
    assert aux.num_rows * AUX_ROW_BYTES > 0
    options = NativeOptions("tcp://127.0.0.1:0", 30.0, 1.0, 30.0, NixlOptions("bench-idle"))
    backend = NixlBackend(regions, options)
    turns = Turns(backend)
    limits = EngineLimits(
        page_size=LAYOUT.page_size,
        chunk_size=64,
        max_batch_tokens=256,
        max_running_requests=8,
        bootstrap_timeout_s=3600.0,
        transfer_timeout_s=3600.0,
    )
    engine = Engine(
        NotRun(),
        turns,  # type: ignore[arg-type]
        EngineKV(PagePool(LAYOUT.num_pages), aux),
        lambda outcome: None,
        limits,
        overlap=False,
    )
    for i in range(num_live):
        engine.submit(
            PrefillRequest(f"r{i}", [1] * 32, SamplingParams(), False, i + 1, time.monotonic())
        )
    stop, inbox = threading.Event(), make_inbox()
    thread = threading.Thread(target=engine.run, args=(stop, inbox))
    thread.start()
    time.sleep(0.2)  # settle
    cpu0, turns0 = time.process_time(), turns.count
    time.sleep(seconds)
    cpu_s, wakeups = time.process_time() - cpu0, turns.count - turns0
    assert engine.load.num_bootstrapping == num_live, engine.load
    stop.set()
    if hasattr(inbox, "wake"):
        inbox.wake()
    thread.join()
    engine.shutdown()
    backend.close()
    return {
        "name": "engine_idle",
        "num_live": num_live,
        "seconds": seconds,
        "cpu_s": round(cpu_s, 4),
        "cpu_fraction": round(cpu_s / seconds, 4),
        "wakeups": wakeups,
    }


class NotRun:
    def run(self, plan: object) -> object:
        raise AssertionError("no request is ever READY here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-live", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    print(json.dumps(measure(args.num_live, args.seconds)))


if __name__ == "__main__":
    main()
