"""Ingress benchmarks, one JSON line each (goals from issue 6).

- ``ingress_codec``: encode + decode + validate one 8192-token ``prefill`` (goal <= 100 us).
- ``ingress_rate``: small ``prefill`` round trips per second through a real ROUTER socket on
  127.0.0.1, the engine replaced by a thread that answers at once (goal >= 20,000/s). The load
  comes from a separate process (pre-encoded frames, a window of requests in flight), so the
  figure is the worker side's: ingress I/O thread + inbox queue + outcome path.

Usage: ``python bench/ingress.py [--requests N] [--window W]``
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefill_worker.ingress.messages import encode, prefill_message
from prefill_worker.ingress.validate import Limits, decode_router
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
)

VOCAB = 151_936


def bench_codec(num_tokens: int = 8192, repeats: int = 3000) -> dict[str, object]:
    rng = random.Random(0)
    tokens = array("i", [rng.randrange(VOCAB) for _ in range(num_tokens)])
    sampling = SamplingParams(0.7, 0.9, 40, 1)
    msg = prefill_message("bench-0", tokens, 12345, sampling, True)
    limits = Limits(VOCAB, num_tokens, 1 << 20)
    expected = PrefillRequest("bench-0", tokens, sampling, True, 12345, 0.0)
    assert decode_router(encode(msg), limits, 0.0) == expected
    best = float("inf")
    for _ in range(5):  # best of five: other processes share these cores
        start = time.perf_counter()
        for _ in range(repeats // 5):
            decode_router(encode(msg), limits)
        best = min(best, (time.perf_counter() - start) / (repeats // 5))
    return {"name": "ingress_codec", "tokens": num_tokens, "us_per_request": round(best * 1e6, 2)}


def _immediate_engine(inbox: queue.Queue[PrefillRequest | AbortRequest], ingress: object) -> None:
    send = ingress.send_outcome  # type: ignore[attr-defined]
    while True:
        item = inbox.get()
        if isinstance(item, AbortRequest):
            return
        send(Outcome(item.request_id, OutcomeStatus.OK, FinishReason.OK, len(item.token_ids)))


def bench_rate(num_requests: int, window: int) -> dict[str, object]:
    from prefill_worker.ingress.zmq_front import Ingress

    inbox: queue.Queue[PrefillRequest | AbortRequest] = queue.Queue()
    ingress = Ingress(
        "tcp://127.0.0.1:0",
        inbox,
        LoadSnapshot,  # an idle engine
        vocab_size=VOCAB,
        max_prompt_tokens=8192,
        max_pool_tokens=1 << 20,
        max_inflight=1 << 20,
    )
    endpoint = ingress.start()
    engine = threading.Thread(target=_immediate_engine, args=(inbox, ingress), daemon=True)
    engine.start()
    try:
        args = [sys.executable, __file__, "--loadgen", endpoint, str(num_requests), str(window)]
        cpu_before = time.process_time()
        out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=300)
        worker_cpu_s = time.process_time() - cpu_before
        seconds = float(out.stdout.strip())
        stats = ingress.stats()
        assert stats.num_admitted == num_requests and stats.num_inflight == 0, stats
    finally:
        inbox.put(AbortRequest("stop"))
        engine.join(5)
        ingress.close()
    return {
        "name": "ingress_rate",
        "req_s": round(num_requests / seconds),
        # CPU the worker process (I/O thread + stand-in engine) spent per request: the figure
        # that stays put when other processes share the cores; 1e6 / it bounds req_s per core.
        "worker_cpu_us_per_request": round(worker_cpu_s / num_requests * 1e6, 2),
        "requests": num_requests,
        "window": window,
        "tokens_per_request": 8,
    }


def loadgen(endpoint: str, num_requests: int, window: int) -> float:
    """Keep ``window`` small prefills in flight; seconds from first send to last reply."""
    import zmq

    frames = [
        encode(prefill_message(f"r{i}", range(i % 100, i % 100 + 8), i))
        for i in range(num_requests)
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    sent = received = 0
    start = time.perf_counter()
    while received < num_requests:
        while sent < num_requests and sent - received < window:
            sock.send(frames[sent], zmq.NOBLOCK)
            sent += 1
        sock.poll(1000)
        while True:
            try:
                sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            received += 1
    elapsed = time.perf_counter() - start
    sock.close(linger=0)
    ctx.term()
    return elapsed


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        print(loadgen(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(bench_codec()), flush=True)
    print(json.dumps(bench_rate(args.requests, args.window)), flush=True)


if __name__ == "__main__":
    main()
