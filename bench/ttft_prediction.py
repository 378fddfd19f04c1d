"""Predicted TTFT against measured TTFT, at low, medium and high load (issue 29).

One worker process (overlap on, chunk 512) on ``e2e.py``'s random Llama checkpoint, its
reference decode peer, and this process as the router. A warm-up of sequential requests gives
the worker a measured forward cost; the capacity (requests/s) is one over the mean of those
prompts' own compute time (``capacity_req_s``).
Then, per load (a Poisson process at a fraction of the capacity, ``e2e.py``'s lognormal
lengths), each request is preceded by a ``ping``: its ``pong`` carries the cost signals, from
which the prediction for the request's length is computed exactly as the worker does
(``load.CostSignals.predicted_ttft_s``); the request follows at once and its TTFT is measured
router send → ``result``. One JSON line per load:
``{"name": "ttft_prediction", "load": ..., "ttft_prediction_error": median |predicted −
measured| / measured, ...}`` (goal ≤ 0.20), to stdout and ``bench/results/ttft_prediction.json``.

    python bench/ttft_prediction.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import tempfile
import time
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


class Bench:
    def __init__(self, target: e2e.Target) -> None:
        self.target = target
        self.router: RouterClient = target.router
        self._rng = random.Random(11)

    async def one(self, num_tokens: int) -> tuple[float | None, float, bool]:
        """(predicted, measured, ok) for one request of ``num_tokens``."""
        predicted = signals_of(await self.router.ping()).predicted_ttft_s(num_tokens)
        ids = [self._rng.randrange(e2e.SHAPE["vocab_size"]) for _ in range(num_tokens)]
        room = self._rng.getrandbits(63)
        sent = time.monotonic()
        self.target.peer.expect(room, ids, 1)
        result = await self.router.prefill(ids, room, timeout_s=300)
        return predicted, time.monotonic() - sent, result.status is OutcomeStatus.OK

    async def point(self, load: list[tuple[float, int]]) -> list[tuple[float | None, float, bool]]:
        start, tasks = time.monotonic(), []
        for offset, n in load:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.ensure_future(self.one(n)))
        return list(await asyncio.gather(*tasks))


async def run(ckpt: Path, tmp: Path, num_per_load: int) -> list[dict[str, object]]:
    target = e2e.Target(ckpt, True, 512, tmp)
    stop = asyncio.Event()
    pumping = asyncio.ensure_future(e2e.pump([target.peer], stop))
    bench, lines = Bench(target), []
    try:
        warm_lengths = [n for _, n in e2e.workload(24, 1.0, seed=1)]
        for n in warm_lengths:  # sequential: the rate, handshake and transfer medians
            await bench.one(n)
        capacity = capacity_req_s(signals_of(await bench.router.ping()), warm_lengths)
        for i, (name, fraction) in enumerate(LOADS.items()):
            rate = fraction * capacity
            samples = await bench.point(e2e.workload(num_per_load, rate, seed=200 + i))
            lines.append(line(name, fraction, rate, samples))
            await asyncio.sleep(1.0)  # the queue empties between loads
    finally:
        stop.set()
        await pumping
        target.close()
    return lines


def line(
    name: str, fraction: float, rate: float, samples: list[tuple[float | None, float, bool]]
) -> dict[str, object]:
    ok = [(p, m) for p, m, is_ok in samples if is_ok and p is not None]
    errors = [abs(p - m) / m for p, m in ok]
    signed = [(p - m) / m for p, m in ok]
    return {
        "name": "ttft_prediction",
        "load": name,
        "fraction_of_capacity": fraction,
        "rate_req_s": round(rate, 2),
        "ttft_prediction_error": round(statistics.median(errors), 3) if errors else None,
        "ttft_prediction_bias": round(statistics.median(signed), 3) if signed else None,
        "ttft_p50_s": round(statistics.median(m for _, m in ok), 4) if ok else None,
        "num_requests": len(samples),
        "num_predicted": len(ok),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = e2e.make_checkpoint(tmp / "ckpt")
        lines = asyncio.run(run(ckpt, tmp, 30 if args.quick else 80))
    e2e.write_lines(lines, e2e.RESULTS / "ttft_prediction.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
