"""Predicted TTFT against measured TTFT, at low, medium and high load (issue 29).

One worker process (overlap on, chunk 512) on ``e2e.py``'s random Llama checkpoint, its
reference decode peer, and this process as the router. A warm-up of sequential requests gives
the worker a measured forward cost; the capacity (requests/s) is one over the mean of those
prompts' own compute time (``capacity_req_s``).
Then, per load (a Poisson process at a fraction of the capacity, ``e2e.py``'s lognormal
lengths), each request is preceded by a ``ping``: its ``pong`` carries the cost signals, from
which the prediction for the request's length is computed exactly as the worker does
(``load.CostSignals.predicted_ttft_s``); the request follows at once and its TTFT is measured
router send → ``result``. The same pong also gives the previous predictor's
(``previous_prediction``, with the median of the bootstrap waits this router saw), so both
models are judged on the same requests. One JSON line per load (with the run's time and
load average: runs accumulate, compare lines of one run):
``{"name": "ttft_prediction", "load": ..., "ttft_prediction_error": median |predicted −
measured| / measured, "ttft_prediction_error_previous": ..., ...}`` (goal ≤ 0.20), to stdout
and appended to ``bench/results/ttft_prediction.json``; with ``--record PATH`` one line per
request (its pong's signals, both predictions, the TTFT and the worker's timings) appended to
``PATH``.

    python bench/ttft_prediction.py [--quick] [--record PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import e2e  # noqa: E402

from prefill_worker.ingress.client import RouterClient  # noqa: E402
from prefill_worker.ingress.messages import Load  # noqa: E402
from prefill_worker.load import CostSignals  # noqa: E402
from prefill_worker.request import OutcomeStatus  # noqa: E402

LOADS = {"low": 0.2, "medium": 0.6, "high": 0.9}  # fractions of the measured capacity


def capacity_req_s(signals: CostSignals, lengths: list[int]) -> float:
    """Requests per second one at a time: the mean of their own compute time on an idle
    worker (a forward's fixed cost per chunk included) inverted."""
    idle = dataclasses.replace(
        signals, queued_tokens=0, running_tokens=0, handshake_s=0.0, transfer_s=0.0
    )
    own_s = [idle.predicted_ttft_s(n) or 1.0 for n in lengths]
    return 1.0 / statistics.mean(own_s)


def previous_prediction(signals: CostSignals, num_tokens: int, handshake_s: float) -> float | None:
    """The predictor as of 5688910, kept to compare later models with on the same requests:
    the whole backlog, then the request's own chunks, then the arrivals over the whole wait
    joining its forwards; ``handshake_s``: the median bootstrap wait of the last 64 requests
    (what that worker published)."""
    rate, size = signals.prefill_rate_tps, signals.max_batch_tokens
    work = signals.queued_tokens + signals.running_tokens
    if rate is None or signals.backlog_s is None:
        return None
    wait_s = max(handshake_s, signals.backlog_s)
    own = math.ceil(num_tokens / signals.chunk_size) if signals.chunk_size else 1
    own_s = own * signals.forward_s + num_tokens / rate
    room = 0  # an unknown batch shape: no room
    if size:
        room = max(math.ceil((work + num_tokens) / size), own) * size - work - num_tokens
    joined = min(signals.arrival_tps * wait_s, room)
    return wait_s + own_s + joined / rate + signals.transfer_s


def signals_of(load: Load) -> CostSignals:
    """The pong's cost signals, as the worker holds them."""
    return CostSignals(
        queued_tokens=load.queued_tokens,  # type: ignore[arg-type]
        running_tokens=load.running_tokens,  # type: ignore[arg-type]
        prefill_rate_tps=load.prefill_rate_tps,  # type: ignore[arg-type]
        handshake_s=load.handshake_s,  # type: ignore[arg-type]
        transfer_s=load.transfer_s,  # type: ignore[arg-type]
        forward_s=load.forward_s,  # type: ignore[arg-type]
        arrival_tps=load.arrival_tps,  # type: ignore[arg-type]
        chunk_size=load.chunk_size,  # type: ignore[arg-type]
        max_batch_tokens=load.max_batch_tokens,  # type: ignore[arg-type]
    )


@dataclasses.dataclass(frozen=True)
class Sample:
    """One request: its TTFT as predicted (the worker's model, and the previous one on the same
    pong) and as measured."""

    predicted: float | None
    previous: float | None
    measured: float
    is_ok: bool


class Bench:
    def __init__(self, target: e2e.Target) -> None:
        self.target = target
        self.router: RouterClient = target.router
        self._rng = random.Random(11)
        self._bootstrap_s: deque[float] = deque(maxlen=64)  # the previous model's handshake
        self.records: list[dict[str, object]] = []  # per request: signals, predicted, measured

    async def one(self, num_tokens: int) -> Sample:
        """One request of ``num_tokens``, predicted from the ``pong`` just before it."""
        signals = signals_of(await self.router.ping())
        handshake_s = statistics.median(self._bootstrap_s) if self._bootstrap_s else 0.0
        predicted = signals.predicted_ttft_s(num_tokens)
        previous = previous_prediction(signals, num_tokens, handshake_s)
        ids = [self._rng.randrange(e2e.SHAPE["vocab_size"]) for _ in range(num_tokens)]
        room = self._rng.getrandbits(63)
        sent = time.monotonic()
        self.target.peer.expect(room, ids, 1)
        result = await self.router.prefill(ids, room, timeout_s=300)
        measured, is_ok = time.monotonic() - sent, result.status is OutcomeStatus.OK
        if is_ok:
            self._bootstrap_s.append(result.timings.bootstrap_s)
        self.records.append(
            {
                "num_tokens": num_tokens,
                "sent_at": round(sent, 6),
                "predicted": predicted,
                "previous": previous,
                "measured": round(measured, 6),
                "ok": is_ok,
                "signals": dataclasses.asdict(signals),
                "timings": dataclasses.asdict(result.timings),
            }
        )
        return Sample(predicted, previous, measured, is_ok)

    async def point(self, load: list[tuple[float, int]]) -> list[Sample]:
        start, tasks = time.monotonic(), []
        for offset, n in load:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.ensure_future(self.one(n)))
        return list(await asyncio.gather(*tasks))


async def run(
    ckpt: Path, tmp: Path, num_per_load: int, record: Path | None = None
) -> list[dict[str, object]]:
    target = e2e.Target(ckpt, True, 512, tmp)
    stop = asyncio.Event()
    pumping = asyncio.ensure_future(e2e.pump([target.peer], stop))
    bench, lines = Bench(target), []
    try:
        warm_lengths = [n for _, n in e2e.workload(24, 1.0, seed=1)]
        for n in warm_lengths:  # sequential: the forward cost, handshake and transfer
            await bench.one(n)
        capacity = capacity_req_s(signals_of(await bench.router.ping()), warm_lengths)
        for i, (name, fraction) in enumerate(LOADS.items()):
            rate = fraction * capacity
            bench.records.clear()
            samples = await bench.point(e2e.workload(num_per_load, rate, seed=200 + i))
            lines.append(line(name, fraction, rate, samples))
            if record is not None:
                with record.open("a") as out:
                    out.writelines(json.dumps({"load": name, **r}) + "\n" for r in bench.records)
            await asyncio.sleep(1.0)  # the queue empties between loads
    finally:
        stop.set()
        await pumping
        target.close()
    return lines


def errors(pairs: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(median |predicted − measured| / measured, median signed) of (predicted, measured)."""
    if not pairs:
        return None, None
    relative = [(p - m) / m for p, m in pairs]
    return round(statistics.median(map(abs, relative)), 3), round(statistics.median(relative), 3)


def line(name: str, fraction: float, rate: float, samples: list[Sample]) -> dict[str, object]:
    ok = [s for s in samples if s.is_ok and s.predicted is not None and s.previous is not None]
    error, bias = errors([(s.predicted, s.measured) for s in ok])  # type: ignore[misc]
    previous, previous_bias = errors([(s.previous, s.measured) for s in ok])  # type: ignore[misc]
    return {
        "name": "ttft_prediction",
        "load": name,
        "fraction_of_capacity": fraction,
        "rate_req_s": round(rate, 2),
        "ttft_prediction_error": error,
        "ttft_prediction_bias": bias,
        "ttft_prediction_error_previous": previous,
        "ttft_prediction_bias_previous": previous_bias,
        "ttft_p50_s": round(statistics.median(s.measured for s in ok), 4) if ok else None,
        "num_requests": len(samples),
        "num_predicted": len(ok),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per load")
    parser.add_argument(
        "--record", type=Path, help="append one JSON line per request (signals, TTFT) to this"
    )
    args = parser.parse_args()
    started, load_before = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = e2e.make_checkpoint(tmp / "ckpt")
        lines = asyncio.run(run(ckpt, tmp, 30 if args.quick else 80, args.record))
    ended, load_after = time.strftime("%H:%M:%S", time.gmtime()), os.getloadavg()[0]
    stamp = f"{started}-{ended} UTC, load average {load_before:.2f}-{load_after:.2f}"
    lines = [{**line, "run": stamp} for line in lines]  # runs accumulate: the machine varies
    e2e.write_lines(lines, e2e.RESULTS / "ttft_prediction.json", append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
