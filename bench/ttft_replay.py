"""The TTFT predictor against a deterministic replay of the engine (issue 29): model error
apart from the machine's noise.

The real ``Engine`` (admission, chunking, queues, the cost signals it publishes) runs with
the scheduler tests' fakes (``tests/unit/scheduler/fakes.py``) on a ``FakeClock``: a forward
of ``t`` tokens moves the clock by ``forward_s + t / rate`` (``--forward-ms``,
``--rate-tps``), the decode wants every request at once and every push lands at the next poll
(no handshake, no transfer: only the forwards are modelled). Arrivals are ``e2e.py``'s
workload (Poisson, lognormal lengths; the bench worker's shape: chunk 512, 2048 tokens a
forward) at a fraction of the capacity, which is computed as ``ttft_prediction.py`` does.

A request arriving while a forward runs is taken when that forward ends, as the worker's
inbox is; its prediction is read from the load the engine published last, as a ``pong``
would report it, and its simulated TTFT is its finish time on the fake clock less its
arrival. The previous predictor (``ttft_prediction.previous_prediction``, with the median
bootstrap wait it used) is computed on the same load. Per load, one JSON line, to stdout and
appended to ``bench/results/ttft_replay.jsonl``: the median |predicted − simulated| /
simulated and the signed median of both; per request (``--record``) the signals, both
predictions, and the forwards it waited through (their tokens, and what was left of the
first when it arrived). Defaults: the bench worker's forward cost on the quiet 2-core
machine (10 ms + 4000 tokens/s).

With ``--workloads K`` each load runs ``K`` workloads (other seeds) and its line gives the
median of their errors and each one's: how much a bench of ``--num`` requests varies from
one draw of arrivals to the next, with no machine in it.

    python bench/ttft_replay.py [--num 400] [--workloads 1] [--forward-ms 10] [--rate-tps 4000]
                                [--record PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import e2e  # noqa: E402
import ttft_prediction  # noqa: E402
from ttft_prediction import errors, previous_prediction  # noqa: E402

from prefill_worker.batch import BatchOutput, BatchPlan  # noqa: E402
from prefill_worker.kv.aux import AuxPool  # noqa: E402
from prefill_worker.kv.pages import PagePool  # noqa: E402
from prefill_worker.load import CostSignals, LoadSnapshot  # noqa: E402
from prefill_worker.request import Outcome, PrefillRequest, SamplingParams  # noqa: E402
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits  # noqa: E402
from tests.clocks import FakeClock  # noqa: E402
from tests.unit.scheduler.fakes import FakeBackend, FakeRunner  # noqa: E402

CHUNK_SIZE, MAX_BATCH_TOKENS = 512, 2048  # e2e.py's worker


class TimedRunner:
    """``FakeRunner`` whose forward of ``t`` tokens takes ``forward_s + t / rate_tps`` on the
    fake clock; keeps when each ran."""

    def __init__(self, inner: FakeRunner, clock: FakeClock, forward_s: float, rate: float):
        self._inner, self._clock = inner, clock
        self._forward_s, self._rate = forward_s, rate
        self.forwards: list[tuple[float, float, int]] = []  # (started, ended, tokens)
        self.load_at_start: list[LoadSnapshot] = []  # what a pong during each forward saw
        self.engine: Engine | None = None

    def run(self, plan: BatchPlan) -> BatchOutput:
        started = self._clock()
        assert self.engine is not None
        self.load_at_start.append(self.engine.load)
        self._clock.advance(self._forward_s + plan.num_tokens / self._rate)
        self.forwards.append((started, self._clock(), plan.num_tokens))
        return self._inner.run(plan)

    def waited(self, arrived_at: float, finished_at: float) -> dict[str, object]:
        """The forwards that ended between a request's arrival and its answer: their tokens,
        and how much of the first was left when it arrived."""
        ran = [f for f in self.forwards if arrived_at < f[1] <= finished_at]
        residual_s = ran[0][1] - max(arrived_at, ran[0][0]) if ran else 0.0
        return {"forward_tokens": [t for _, _, t in ran], "residual_s": residual_s}


class Replay:
    """One engine on a fake clock; ``run`` feeds it a workload."""

    def __init__(self, forward_s: float, rate_tps: float) -> None:
        self.clock = FakeClock()
        pool, aux = PagePool(e2e.NUM_PAGES), AuxPool(1024)
        backend = FakeBackend(pool, aux, auto_want=True)
        self.runner = TimedRunner(FakeRunner(pool, e2e.PAGE_SIZE), self.clock, forward_s, rate_tps)
        self.outcomes: dict[str, tuple[Outcome, float]] = {}
        limits = EngineLimits(
            page_size=e2e.PAGE_SIZE,
            chunk_size=CHUNK_SIZE,
            max_batch_tokens=MAX_BATCH_TOKENS,
            max_running_requests=64,
            bootstrap_timeout_s=1e6,
            transfer_timeout_s=1e6,
        )
        kv = EngineKV(pool, aux, None)
        self.engine = Engine(
            self.runner, backend, kv, self._finished, limits, overlap=False, clock=self.clock
        )
        self.runner.engine = self.engine
        self._pool, self._aux = pool, aux
        self._num_sent = 0
        self._bootstrap_s: list[float] = []  # every outcome's, in order: the previous model's

    def _finished(self, outcome: Outcome) -> None:
        self.outcomes[outcome.request_id] = (outcome, self.clock())
        self._bootstrap_s.append(outcome.timings.bootstrap_s)

    def submit(self, num_tokens: int, arrival_time: float) -> str:
        self._num_sent += 1
        request_id = f"r{self._num_sent}"
        tokens = [(7919 * self._num_sent + i) % 50000 for i in range(num_tokens)]
        self.engine.submit(
            PrefillRequest(
                request_id=request_id,
                token_ids=tokens,
                sampling=SamplingParams(),
                return_logprob=False,
                bootstrap_room=self._num_sent,
                arrival_time=arrival_time,
            )
        )
        return request_id

    def _handshake_s(self) -> float:
        """The median bootstrap wait of the last 64 outcomes (what the previous model used)."""
        recent = self._bootstrap_s[-64:]
        return statistics.median(recent) if recent else 0.0

    def run(self, workload: list[tuple[float, int]]) -> list[dict[str, object]]:
        """Each request's prediction (from the load published last before it arrived) and
        simulated TTFT. Arrivals during a turn (its forward moved the clock past them) are
        taken after it, as the worker's inbox is, having seen the load of before it."""
        start, pending = self.clock(), list(workload)
        sent: dict[str, tuple[dict[str, object], float]] = {}
        while pending or any(request_id not in self.outcomes for request_id in sent):
            seen, handshake_s = self.engine.load, self._handshake_s()
            num_forwards = len(self.runner.forwards)
            is_busy = self.engine.step()
            if len(self.runner.forwards) > num_forwards:  # arrivals during it saw what it
                seen = self.runner.load_at_start[-1]  # published before collecting
            is_idle = not is_busy and not self.engine.load.num_live
            if is_idle and pending and start + pending[0][0] > self.clock():
                self.clock.now = start + pending[0][0]  # nothing to do until the next arrival
                seen, handshake_s = self.engine.load, self._handshake_s()
            while pending and start + pending[0][0] <= self.clock():
                offset, n = pending.pop(0)
                arrived_at = start + offset
                record: dict[str, object] = {
                    "num_tokens": n,
                    "signals": asdict(seen.costs),
                    "predicted": seen.costs.predicted_ttft_s(n),
                    "previous": previous_prediction(seen.costs, n, handshake_s),
                }
                request_id = self.submit(n, arrived_at)
                sent[request_id] = (record, arrived_at)
        self.engine.check_integrity()
        assert self._pool.num_free == self._pool.num_pages and self._aux.num_free == 1024
        records = []
        for request_id, (record, arrived_at) in sent.items():
            _, finished_at = self.outcomes[request_id]
            record["simulated"] = finished_at - arrived_at
            records.append({**record, **self.runner.waited(arrived_at, finished_at)})
        return records


def line(name: str, rate: float, records: list[dict[str, object]]) -> dict[str, object]:
    pairs = [(r["predicted"], r["previous"], r["simulated"]) for r in records]
    error, bias = errors([(p, m) for p, _, m in pairs])  # type: ignore[misc]
    previous, previous_bias = errors([(q, m) for _, q, m in pairs])  # type: ignore[misc]
    return {
        "name": "ttft_replay",
        "load": name,
        "rate_req_s": round(rate, 2),
        "ttft_prediction_error": error,
        "ttft_prediction_bias": bias,
        "ttft_prediction_error_previous": previous,
        "ttft_prediction_bias_previous": previous_bias,
        "ttft_p50_s": round(statistics.median(m for _, _, m in pairs), 4),  # type: ignore[misc]
        "num_requests": len(pairs),
    }


def spread(name: str, rate: float, runs: list[dict[str, object]]) -> dict[str, object]:
    """One load over several workloads: each workload's errors, and their medians."""
    keys = ("ttft_prediction_error", "ttft_prediction_error_previous")
    per_run = {key: [run[key] for run in runs] for key in keys}
    return {
        "name": "ttft_replay",
        "load": name,
        "rate_req_s": round(rate, 2),
        **{key: round(statistics.median(values), 3) for key, values in per_run.items()},  # type: ignore
        **{f"{key}_per_workload": values for key, values in per_run.items()},
        "num_requests": runs[0]["num_requests"],
        "num_workloads": len(runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=400, help="requests per load")
    parser.add_argument("--workloads", type=int, default=1, help="workloads (seeds) per load")
    parser.add_argument("--forward-ms", type=float, default=10.0, help="a forward's fixed cost")
    parser.add_argument("--rate-tps", type=float, default=4000.0, help="a forward's tokens/s")
    parser.add_argument("--record", type=Path, help="append one JSON line per request to this")
    args = parser.parse_args()
    forward_s = args.forward_ms / 1000
    idle = CostSignals(
        prefill_rate_tps=args.rate_tps,
        forward_s=forward_s,
        chunk_size=CHUNK_SIZE,
        max_batch_tokens=MAX_BATCH_TOKENS,
    )
    warm = [n for _, n in e2e.workload(24, 1.0, seed=1)]
    capacity = ttft_prediction.capacity_req_s(idle, warm)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in ttft_prediction.LOADS}
    for k in range(args.workloads):  # one worker through the loads in turn, as the bench's
        replay = Replay(forward_s, args.rate_tps)
        replay.run(e2e.workload(24, 1.0, seed=1))  # warm-up, as the bench's: the forward fit
        for i, (name, fraction) in enumerate(ttft_prediction.LOADS.items()):
            records = replay.run(e2e.workload(args.num, fraction * capacity, seed=200 + i + 10 * k))
            runs[name].append(line(name, fraction * capacity, records))
            replay.clock.advance(1.0)  # the bench's pause between loads
            if args.record is not None:
                with args.record.open("a") as out:
                    out.writelines(json.dumps({"load": name, **r}) + "\n" for r in records)
    shape = {"forward_ms": args.forward_ms, "rate_tps": args.rate_tps}
    lines = []
    for name, fraction in ttft_prediction.LOADS.items():
        mine = runs[name]
        lines.append({**(mine[0] if len(mine) == 1 else spread(name, fraction * capacity, mine))})
        lines[-1].update(shape)
    e2e.write_lines(lines, e2e.RESULTS / "ttft_replay.jsonl", append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
