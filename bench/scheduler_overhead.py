"""Scheduler overhead: the CPU cost of one engine turn, and how much of it overlap hides.

Prints JSON lines:

* ``{"name": "scheduler_step", "queued": N, "step_us_p50", "step_us_p99"}``: one ``step()``
  with a no-op runner and sender while N requests are queued (half waiting for their decode
  peer's handshake, half handshaken and waiting for pages), refilled after every turn so the
  queue stays at N while requests keep flowing through. Goals: p50 <= 200 us at 1000,
  <= 1 ms at 10000.
* ``{"name": "overlap", "serial_s", "overlapped_s", "hidden_fraction", ...}``: the same
  batches with a runner that sleeps ``forward_ms`` per batch while each turn's first poll
  costs ``cpu_ms`` of CPU. The fake backend turns as a real one does: a later poll in the
  same turn finds nothing, and ``wait`` sleeps on the forward's done fd until the timeout
  (the engine keeps the backend turning while a forward runs). ``hidden_fraction`` =
  1 - (overlapped - its forward time) / (serial - its forward time): the share of the
  loop's own work that ran under the forward (each run's forwards timed, so a sleep's
  overshoot on a loaded machine counts as neither); the median of ``--rounds``
  serial/overlapped pairs, optimistic prefill on. Goal: >= 0.8.

To stdout and ``bench/results/scheduler_overhead.json``. Torch-free; ratios within one run,
not absolute times, are what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import select
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from prefill_worker.batch import BatchOutput, BatchPlan, SampledToken
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.request import PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from prefill_worker.transfer.base import KVPoll

PAGE_SIZE = 16
RESULTS = Path(__file__).resolve().parent / "results"


class NoopRunner:
    def __init__(self, forward_s: float = 0.0) -> None:
        self.forward_s = forward_s
        self.total_s = 0.0

    def run(self, plan: BatchPlan) -> BatchOutput:
        if self.forward_s:
            started = time.perf_counter()
            time.sleep(self.forward_s)
            self.total_s += time.perf_counter() - started
        return BatchOutput(
            plan.batch_id,
            tuple(SampledToken(c.request_id, 1, 0.0) for c in plan.chunks if c.sampling),
        )


class NoopSender:
    """Ready at once (or never); a transfer succeeds on the first poll after ``send_aux``."""

    __slots__ = ("state",)

    def __init__(self, ready: bool) -> None:
        self.state = KVPoll.READY if ready else KVPoll.BOOTSTRAPPING

    def poll(self) -> KVPoll:
        return self.state

    def num_cached_tokens(self) -> int:
        return 0

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        self.state = KVPoll.TRANSFERRING

    def send_aux(self, aux_row: int) -> None:
        self.state = KVPoll.SUCCESS

    def fail(self, reason: str) -> None:
        self.state = KVPoll.FAILED

    def failure_reason(self) -> str | None:
        return None

    def written_bytes(self) -> int:
        return 0

    def close(self) -> None:
        return None


class NoopBackend:
    """Turns as a real backend does: the messages that arrived since the last turn cost
    ``poll_cpu_s`` of CPU on the turn's first ``poll`` (``new_turn`` brings them), and a
    later ``poll`` in the same turn finds nothing; ``wait`` sleeps until ``wake_fd`` (the
    inbox, or the forward's done fd) is readable or ``timeout_s`` passes."""

    def __init__(self, poll_cpu_s: float = 0.0) -> None:
        self.poll_cpu_s = poll_cpu_s
        self.next_ready = True
        self.has_messages = False

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> NoopSender:
        return NoopSender(self.next_ready)

    def new_turn(self) -> None:
        self.has_messages = True

    def poll(self) -> None:
        if not self.has_messages:
            return
        self.has_messages = False
        end = time.perf_counter() + self.poll_cpu_s
        while time.perf_counter() < end:
            pass

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        select.select([] if wake_fd is None else [wake_fd], [], [], timeout_s)

    def close(self) -> None:
        return None


def make_engine(
    runner: NoopRunner, backend: NoopBackend, overlap: bool, optimistic: bool = False
) -> Engine:
    return Engine(
        runner,
        backend,
        EngineKV(PagePool(1024), AuxPool(256)),
        lambda outcome: None,
        EngineLimits(
            page_size=PAGE_SIZE,
            chunk_size=512,
            max_batch_tokens=2048,
            max_running_requests=64,
            bootstrap_timeout_s=3600.0,
            transfer_timeout_s=3600.0,
            optimistic_prefill=optimistic,
        ),
        overlap=overlap,
    )


class Feeder:
    def __init__(self, engine: Engine, backend: NoopBackend, prompt_tokens: int) -> None:
        self.engine, self.backend = engine, backend
        self.tokens = list(range(prompt_tokens))
        self.count = 0

    def submit(self, ready: bool) -> None:
        self.backend.next_ready = ready
        self.count += 1
        rid = f"r{self.count}"
        msg = PrefillRequest(
            rid, self.tokens, SamplingParams(), False, self.count, time.monotonic()
        )
        self.engine.submit(msg)


def bench_step(queued: int, turns: int) -> dict:
    backend = NoopBackend()
    engine = make_engine(NoopRunner(), backend, overlap=False)
    feeder = Feeder(engine, backend, prompt_tokens=256)
    for i in range(queued):
        feeder.submit(ready=i % 2 == 1)
    samples = []
    for turn in range(turns + 50):
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        if turn >= 50:
            samples.append(elapsed)
        load = engine.load
        for _ in range(queued - load.num_bootstrapping - load.num_waiting):
            feeder.submit(ready=True)
    engine.shutdown()
    samples.sort()
    return {
        "name": "scheduler_step",
        "queued": queued,
        "step_us_p50": round(statistics.median(samples) * 1e6, 1),
        "step_us_p99": round(samples[int(0.99 * (len(samples) - 1))] * 1e6, 1),
        "completed": sum(engine.outcome_counts.values()),
        "turns": turns,
    }


def run_batches(overlap: bool, num_batches: int, forward_s: float, cpu_s: float) -> tuple:
    runner, backend = NoopRunner(forward_s), NoopBackend(cpu_s)
    engine = make_engine(runner, backend, overlap, optimistic=True)
    feeder = Feeder(engine, backend, prompt_tokens=2048)  # one request = one full batch
    for _ in range(num_batches):
        feeder.submit(ready=True)
    started = time.perf_counter()
    while True:
        backend.new_turn()
        if not (engine.step() or engine.load.num_live):
            break
    elapsed = time.perf_counter() - started
    engine.shutdown()
    assert sum(engine.outcome_counts.values()) == num_batches
    return elapsed, runner.total_s


def bench_overlap(num_batches: int, forward_ms: float, cpu_ms: float, rounds: int) -> dict:
    """Serial and overlapped take turns, ``rounds`` times (a loaded machine's sleeps overshoot
    now and then); the line gives the median round's hidden fraction."""
    fractions, serial, overlapped = [], [], []
    for _ in range(rounds):
        serial_s, forward_s = run_batches(False, num_batches, forward_ms / 1e3, cpu_ms / 1e3)
        overlapped_s, o_forward_s = run_batches(True, num_batches, forward_ms / 1e3, cpu_ms / 1e3)
        # each run's own forward time: a sleep's overshoot is not the loop's work
        fractions.append(1.0 - (overlapped_s - o_forward_s) / (serial_s - forward_s))
        serial.append(serial_s)
        overlapped.append(overlapped_s)
    return {
        "name": "overlap",
        "serial_s": round(statistics.median(serial), 4),
        "overlapped_s": round(statistics.median(overlapped), 4),
        "hidden_fraction": round(statistics.median(fractions), 3),
        "hidden_fraction_rounds": [round(f, 3) for f in fractions],
        "num_batches": num_batches,
        "forward_ms": forward_ms,
        "cpu_ms": cpu_ms,
        "optimistic_prefill": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--cpu-ms", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "scheduler_overhead.json").open("w") as out:
        lines = [bench_step(queued, args.turns) for queued in (1000, 10000)]
        lines.append(bench_overlap(args.batches, args.forward_ms, args.cpu_ms, args.rounds))
        for entry in lines:
            print(json.dumps(entry), flush=True)
            out.write(json.dumps(entry) + "\n")


if __name__ == "__main__":
    main()
