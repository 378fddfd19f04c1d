"""Requests nobody claims, beside requests that are claimed (issue #40, findings 4 and 5).

``e2e.py``'s worker (random Llama, overlap on, chunk 512, 4,096 pages of 16 tokens) and its
reference decode peer; this process is the router. A flood of ``N`` requests (random
256-token prompts) is sent whose rooms no decode ever claims (bootstrap timeout 600 s), then
legit requests, one at a time, whose decode claims their room: alternately before the
prompt comes (``want`` first) and just after it. Per optimistic mode (``off``, ``on``):

- ``claim``: for N in 0, 1,000, 4,000: the legit TTFT (router send → result) p50 and max.
- ``prefix``: a legit user's 24 prompts share a 1,024-token prefix; 8 warm it, then 4,000
  unclaimed prompts arrive and 16 more legit ones are sent after them: how many of those hit
  the prefix cache, the legit TTFT p50, and the tokens the worker forwarded over the tokens
  the legit requests computed (``prefill_worker_batch_tokens`` sum; ``forwarded_ratio``).

The flood is aborted after each point and the worker left idle before the next.

JSON lines to stdout, appended to ``bench/results/unclaimed.jsonl``::

    {"name": "unclaimed", "scenario": "claim", "optimistic": bool, "num_unclaimed": N,
     "ttft_p50_s", "ttft_max_s"}
    {"name": "unclaimed", "scenario": "prefix", "optimistic": bool, "num_unclaimed": N,
     "hits": "h/16", "ttft_p50_s", "forwarded_ratio"}

Goals: the claim TTFT p50 at 4,000 unclaimed within 3x that at 0; 16/16 prefix hits.

    python bench/unclaimed.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import e2e  # noqa: E402

from prefill_worker.ingress.client import RouterClient  # noqa: E402
from prefill_worker.request import OutcomeStatus  # noqa: E402
from prefill_worker.testing.launch import free_port  # noqa: E402

FLOOD_TOKENS, LEGIT_TOKENS, PREFIX_TOKENS = 256, 64, 1024


class Bench:
    """One worker (one optimistic mode) and what it is sent."""

    def __init__(self, ckpt: Path, workdir: Path, optimistic: bool) -> None:
        self.metrics_port = free_port()
        extra = {
            "scheduler.optimistic_prefill": str(optimistic).lower(),
            "scheduler.bootstrap_timeout_s": 600,
            "metrics.bind": f"127.0.0.1:{self.metrics_port}",
        }
        self.optimistic = optimistic
        self.target = e2e.Target(ckpt, True, 512, workdir, extra)
        self.router: RouterClient = self.target.router
        self._rng = random.Random(11)
        self.phases: list[tuple[float, float, float, float]] = []  # the legit requests'

    def tokens(self, num: int) -> list[int]:
        return [self._rng.randrange(e2e.SHAPE["vocab_size"]) for _ in range(num)]

    def forwarded_tokens(self) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("prefill_worker_batch_tokens_sum "):
                    return float(line.split()[1])
        raise AssertionError("no prefill_worker_batch_tokens_sum on /metrics")

    async def legit(self, ids: list[int], want_first: bool) -> tuple[float, int]:
        """(TTFT, prefix-hit tokens) of one claimed request; its phases in ``phases``."""
        room = random.getrandbits(63)
        sent = time.monotonic()
        if want_first:
            self.target.peer.expect(room, ids, 1)
        else:
            asyncio.get_running_loop().call_soon(self.target.peer.expect, room, ids, 1)
        result = await self.router.prefill(ids, room, timeout_s=300)
        assert result.status is OutcomeStatus.OK, result
        t = result.timings
        self.phases.append((t.queue_s, t.bootstrap_s, t.prefill_s, t.transfer_s))
        hits = result.num_prefix_hit_tokens
        return time.monotonic() - sent, hits if isinstance(hits, int) else 0

    async def idle(self) -> None:
        """Until the worker has nothing queued or running (the aborted flood has ended)."""
        while True:
            load = await self.router.ping(timeout_s=60)
            if load.waiting == 0 and load.running == 0 and not load.queued_tokens:
                return
            await asyncio.sleep(0.2)


async def claim_points(bench: Bench, sizes: tuple[int, ...], num_legit: int) -> list[dict]:
    lines = []
    for num in sizes:
        bench.phases.clear()
        flood = await send_flood(bench, num)
        ttfts = [(await bench.legit(bench.tokens(LEGIT_TOKENS), i % 2 == 0))[0]
                 for i in range(num_legit)]  # fmt: skip
        await drop_flood(bench, flood)
        lines.append({
            "name": "unclaimed", "scenario": "claim", "optimistic": bench.optimistic,
            "num_unclaimed": num, "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_max_s": round(max(ttfts), 4), "phases_p50_s": phases_p50(bench),
        })  # fmt: skip
        print(json.dumps(lines[-1]), flush=True)
    return lines


def phases_p50(bench: Bench) -> dict[str, float]:
    """The legit requests' median seconds per phase (``result.timings``)."""
    names = ("queue", "bootstrap", "prefill", "transfer")
    return {n: round(statistics.median(p[i] for p in bench.phases), 4) for i, n in enumerate(names)}


async def prefix_point(bench: Bench, num: int) -> dict:
    prefix = bench.tokens(PREFIX_TOKENS)
    for i in range(8):
        await bench.legit(prefix + bench.tokens(16), i % 2 == 0)
    before = bench.forwarded_tokens()
    bench.phases.clear()
    flood = await send_flood(bench, num)
    samples = [await bench.legit(prefix + bench.tokens(16), i % 2 == 0) for i in range(16)]
    forwarded = bench.forwarded_tokens() - before
    await drop_flood(bench, flood)
    hits = sum(1 for _, h in samples if h >= PREFIX_TOKENS)
    legit_computed = sum(PREFIX_TOKENS + 16 - h for _, h in samples)
    line = {
        "name": "unclaimed", "scenario": "prefix", "optimistic": bench.optimistic,
        "num_unclaimed": num, "hits": f"{hits}/16",
        "ttft_p50_s": round(statistics.median(t for t, _ in samples), 4),
        "forwarded_ratio": round(forwarded / max(legit_computed, 1), 1),
        "phases_p50_s": phases_p50(bench),
    }  # fmt: skip
    print(json.dumps(line), flush=True)
    return line


Flood = list[tuple[str, "asyncio.Future[object]"]]


async def send_flood(bench: Bench, num: int) -> Flood:
    """``num`` prompts whose rooms nobody claims: (id, its pending result) each."""
    flood: Flood = []
    for i in range(num):
        rid = f"flood-{random.getrandbits(48):x}"
        wait = bench.router.prefill(bench.tokens(FLOOD_TOKENS), random.getrandbits(63),
                                    request_id=rid, timeout_s=900)  # fmt: skip
        flood.append((rid, asyncio.ensure_future(wait)))
        if i % 256 == 255:
            await asyncio.sleep(0)  # the sends go out
    await bench.router.ping(timeout_s=60)  # after them: the ingress has read them all
    return flood


async def drop_flood(bench: Bench, flood: Flood) -> None:
    """Abort every flooded request, take their results, wait for an idle worker."""
    for rid, _ in flood:
        await bench.router.abort(rid)
    await asyncio.gather(*(wait for _, wait in flood), return_exceptions=True)
    await bench.idle()


async def run(ckpt: Path, tmp: Path, quick: bool, modes: list[bool]) -> list[dict]:
    sizes = (0, 1000) if quick else (0, 1000, 4000)
    lines: list[dict] = []
    for optimistic in modes:
        workdir = tmp / ("on" if optimistic else "off")
        workdir.mkdir()
        bench = Bench(ckpt, workdir, optimistic)
        stop = asyncio.Event()
        pumping = asyncio.ensure_future(e2e.pump([bench.target.peer], stop))
        try:
            for _ in range(4):  # warm-up
                await bench.legit(bench.tokens(LEGIT_TOKENS), True)
            lines += await claim_points(bench, sizes, 10 if quick else 20)
            lines.append(await prefix_point(bench, 1000 if quick else 4000))
        finally:
            stop.set()
            await pumping
            bench.target.close()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer points and requests")
    parser.add_argument("--modes", default="off,on", help="optimistic modes to run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-unclaimed-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = e2e.make_checkpoint(tmp / "ckpt")
        modes = [m == "on" for m in args.modes.split(",")]
        lines = asyncio.run(run(ckpt, tmp, args.quick, modes))
    e2e.write_lines(lines, e2e.RESULTS / "unclaimed.jsonl", append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
