"""Optimistic prefill on and off against a decode that claims its rooms late (issue 29).

Two worker processes (``scheduler.optimistic_prefill`` off and on; otherwise
``e2e.py``'s worker: random Llama checkpoint, overlap on, chunk 512), each with ``e2e.py``'s
reference decode peer, this process as the router. The decode claims each room ``delay``
seconds after the router sent the request (``DecodePeer.expect`` then: its `want` follows).

- The prefill time ``p``: per delay point, the median ``timings.prefill_s`` of that point's own
  prompts (``e2e.py``'s lognormal lengths), sent one at a time to the off worker first, so a
  delay of ``p`` is the prefill time of the prompts it delays (calibrated on other prompts it
  was shorter or longer than theirs, which moved ``ttft_ratio`` by up to 0.1 from run to run).
  Delays: ``zero``, ``prefill`` (``p``), ``3x``.
- Per delay and mode, the same prompts for both: one request at a time by default (the TTFT
  a request sees on an idle worker), or with ``--load-fraction F`` Poisson arrivals at ``F``
  of the off worker's capacity (queueing adds the same wait to both modes); TTFT is router
  send → ``result``.
- Throughput at ``zero``: bursts of 16 requests all sent at once, 8 rounds (4 with
  ``--quick``), off and on in turn with the same prompts per round (off first in even rounds,
  on first in odd ones); a round's ratio is off's time to the last result over on's, the
  line's ``throughput_ratio`` their median (a loaded machine's noise hits single bursts).
- The TTFT prediction at low, medium and high load as ``ttft_prediction.py`` measures it, off
  and on (the line's ``optimistic_prefill``).

Both workers run for the whole bench and take turns (request by request; with Poisson
arrivals each point in two halves, off then on), so a drift in the machine's load falls on
both alike.

JSON lines to stdout, appended to ``bench/results/optimistic.jsonl``::

    {"name": "optimistic", "delay": "zero" | "prefill" | "3x", "ttft_p50_on_s", "ttft_p50_off_s",
     "ttft_p99_on_s", "ttft_p99_off_s", "ttft_ratio": on/off p50, "throughput_ratio": on/off}
    {"name": "optimistic", "load": "low" | "medium" | "high", "ttft_prediction_error": ...}

Goals: ``ttft_ratio`` <= 0.65 at ``prefill``; ``throughput_ratio`` >= 0.97 at ``zero``;
``ttft_prediction_error`` <= 0.20.

    python bench/optimistic.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import e2e  # noqa: E402
import ttft_prediction  # noqa: E402
from msgspec import UnsetType  # noqa: E402

from prefill_worker.request import OutcomeStatus  # noqa: E402

DELAYS = {"zero": 0.0, "prefill": 1.0, "3x": 3.0}  # multiples of the prefill time
MODES = ("off", "on")


@dataclass
class Measured:
    """What one mode gave: TTFTs per delay, and the burst's throughput."""

    ttfts: dict[str, list[float]] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    burst_s: list[float] = field(default_factory=list)  # one per round, same prompts per round
    num_burst: int = 0


def throughput_ratios(off: Measured, on: Measured) -> list[float]:
    """on/off throughput per burst round (the same prompts in both): off's time over on's."""
    return [t_off / t_on for t_off, t_on in zip(off.burst_s, on.burst_s, strict=True)]


class Router:
    """Sends requests to one worker; its decode claims each room ``delay_s`` later."""

    def __init__(self, target: e2e.Target) -> None:
        self.target = target
        self._rng = random.Random(5)

    async def one(self, num_tokens: int, delay_s: float) -> tuple[float, bool, int, float]:
        """(TTFT, ok, prefill retries, prefill_s) of one request."""
        ids = [self._rng.randrange(e2e.SHAPE["vocab_size"]) for _ in range(num_tokens)]
        room = self._rng.getrandbits(63)
        loop = asyncio.get_running_loop()
        sent = time.monotonic()
        loop.call_later(delay_s, self.target.peer.expect, room, ids, 1)
        result = await self.target.router.prefill(ids, room, timeout_s=300)
        t = result.timings
        is_ok = result.status is OutcomeStatus.OK
        retries = 0 if isinstance(result.prefill_retries, UnsetType) else result.prefill_retries
        return time.monotonic() - sent, is_ok, retries, t.prefill_s

    async def load(
        self, workload: list[tuple[float, int]], delay_s: float
    ) -> list[tuple[float, bool, int, float]]:
        start, tasks = time.monotonic(), []
        for offset, n in workload:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.ensure_future(self.one(n, delay_s)))
        return list(await asyncio.gather(*tasks))


def start_target(ckpt: Path, tmp: Path, optimistic: bool) -> e2e.Target:
    extra = {"scheduler.optimistic_prefill": str(optimistic).lower()}
    return e2e.Target(ckpt, True, 512, tmp / ("on" if optimistic else "off"), extra)


def point_workloads(index: int, num: int, rate: float) -> list[list[tuple[float, int]]]:
    """What the ``index``-th delay point sends: one workload one at a time (``rate`` 0), or
    two halves of Poisson arrivals at ``rate``."""
    if not rate:
        return [e2e.workload(num, 1.0, seed=300 + 10 * index)]
    return [e2e.workload(num // 2, rate, seed=300 + 10 * index + half) for half in range(2)]


def point_lengths(index: int, num: int, rate: float) -> list[int]:
    """The prompt lengths the ``index``-th delay point sends."""
    return [n for workload in point_workloads(index, num, rate) for _, n in workload]


async def calibrate(
    target: e2e.Target, num: int, lengths: list[int] | None = None
) -> tuple[float, float]:
    """(median prefill seconds, capacity in requests/s) from sequential requests: ``lengths``,
    or ``num`` of the warm-up's."""
    router = Router(target)
    lengths = lengths or [n for _, n in e2e.workload(num, 1.0, seed=1)]
    prefill, ttft = [], []
    for n in lengths:
        t, ok, _, prefill_s = await router.one(n, 0.0)
        assert ok
        prefill.append(prefill_s)
        ttft.append(t)
    return statistics.median(prefill), 1.0 / statistics.mean(ttft)


async def measure(
    routers: dict[str, Router],
    delays: dict[str, float],
    rate: float,
    num: int,
    burst_shape: tuple[int, int],
) -> dict[str, Measured]:
    """Off and on take turns (the machine's load drifts): request by request, or with Poisson
    arrivals each point in two halves; ``burst_shape``: (requests per burst, rounds)."""
    burst, rounds = burst_shape
    out = {mode: Measured() for mode in routers}
    for i, (name, delay_s) in enumerate(delays.items()):
        if not rate:  # one at a time: off and on take turns request by request
            for n in point_lengths(i, num, rate):
                for mode, router in routers.items():
                    t, ok, retries, _ = await router.one(n, delay_s)
                    out[mode].ttfts.setdefault(name, []).extend([t] if ok else [])
                    out[mode].retries[name] = out[mode].retries.get(name, 0) + retries
            continue
        for workload in point_workloads(i, num, rate):  # two halves
            for mode, router in routers.items():
                samples = await router.load(workload, delay_s)
                out[mode].ttfts.setdefault(name, []).extend(t for t, ok, _, _ in samples if ok)
                retries = sum(r for _, ok, r, _ in samples if ok)
                out[mode].retries[name] = out[mode].retries.get(name, 0) + retries
                await asyncio.sleep(0.5)
    for i in range(rounds):  # off first, then on first, ...: neither always goes second
        lengths = [n for _, n in e2e.workload(burst, 1.0, seed=400 + i)]
        order = list(routers.items()) if i % 2 == 0 else list(routers.items())[::-1]
        for mode, router in order:
            started = time.monotonic()
            samples = await router.load([(0.0, n) for n in lengths], 0.0)
            assert all(ok for _, ok, _, _ in samples)
            out[mode].burst_s.append(time.monotonic() - started)
            out[mode].num_burst += len(samples)
    for measured in out.values():
        for ttfts in measured.ttfts.values():
            ttfts.sort()
    return out


async def predictions(targets: dict[str, e2e.Target], num: int) -> list[dict[str, object]]:
    """``ttft_prediction.py``'s measurement, per load off and on in turn."""
    benches = {mode: ttft_prediction.Bench(target) for mode, target in targets.items()}
    warm = [n for _, n in e2e.workload(12, 1.0, seed=1)]
    capacity = {}
    for mode, bench in benches.items():
        for n in warm:
            await bench.one(n)
        signals = ttft_prediction.signals_of(await bench.router.ping())
        capacity[mode] = ttft_prediction.capacity_req_s(signals, warm)
    lines = []
    for i, (name, fraction) in enumerate(ttft_prediction.LOADS.items()):
        for mode, bench in benches.items():
            rate = fraction * capacity[mode]
            samples = await bench.point(e2e.workload(num, rate, seed=200 + i))
            entry = ttft_prediction.line(name, fraction, rate, samples)
            lines.append({**entry, "name": "optimistic", "optimistic_prefill": mode == "on"})
            await asyncio.sleep(1.0)
    return lines


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def delay_lines(off: Measured, on: Measured, delays: dict[str, float]) -> list[dict[str, object]]:
    ratios = throughput_ratios(off, on)
    lines = []
    for name, delay_s in delays.items():
        p50_on, p50_off = quantile(on.ttfts[name], 0.5), quantile(off.ttfts[name], 0.5)
        lines.append(
            {
                "name": "optimistic",
                "delay": name,
                "delay_s": round(delay_s, 4),
                "ttft_p50_on_s": round(p50_on, 4),
                "ttft_p50_off_s": round(p50_off, 4),
                "ttft_p99_on_s": round(quantile(on.ttfts[name], 0.99), 4),
                "ttft_p99_off_s": round(quantile(off.ttfts[name], 0.99), 4),
                "ttft_ratio": round(p50_on / p50_off, 3),
                "throughput_ratio": round(statistics.median(ratios), 3),
                "throughput_ratio_rounds": [round(r, 3) for r in ratios],
                "prefill_retries_on": on.retries[name],
                "num_ok": [len(off.ttfts[name]), len(on.ttfts[name])],
            }
        )
    return lines


async def run(
    ckpt: Path,
    tmp: Path,
    num: int,
    burst_shape: tuple[int, int],
    load_fraction: float,
    with_predictions: bool,
) -> list[dict[str, object]]:
    """Both workers up at once; only one has work at a time."""
    targets = {mode: start_target(ckpt, tmp, mode == "on") for mode in MODES}
    stop = asyncio.Event()
    pumping = asyncio.ensure_future(e2e.pump([t.peer for t in targets.values()], stop))
    try:
        routers = {mode: Router(target) for mode, target in targets.items()}
        await calibrate(targets["on"], 4)  # the same warm-up for both
        _, capacity = await calibrate(targets["off"], 12)
        rate, delays = load_fraction * capacity, {}
        for i, (name, k) in enumerate(DELAYS.items()):  # k x the point's own prompts' prefill
            lengths = point_lengths(i, num, rate)
            delays[name] = k * (await calibrate(targets["off"], 0, lengths))[0] if k else 0.0
        measured = await measure(routers, delays, rate, num, burst_shape)
        lines = delay_lines(measured["off"], measured["on"], delays)
        for entry in lines:
            entry["load_fraction"] = load_fraction or "one at a time"
        return lines + (await predictions(targets, num) if with_predictions else [])
    finally:
        stop.set()
        await pumping
        for target in targets.values():
            target.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per point")
    parser.add_argument(
        "--load-fraction", type=float, default=0.0, help="Poisson arrivals (0: one at a time)"
    )
    parser.add_argument("--no-prediction", action="store_true", help="skip the TTFT prediction")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-optimistic-") as tmp_name:
        tmp = Path(tmp_name)
        for mode in MODES:
            (tmp / mode).mkdir()
        ckpt = e2e.make_checkpoint(tmp / "ckpt")
        num, burst_shape = (20, (16, 4)) if args.quick else (40, (16, 8))
        lines = asyncio.run(
            run(ckpt, tmp, num, burst_shape, args.load_fraction, not args.no_prediction)
        )
    e2e.write_lines(lines, e2e.RESULTS / "optimistic.jsonl", append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
