"""End to end under load: this process plays router and decode against a real worker process.

A random Llama checkpoint of small but realistic proportions (hidden 512, 4 layers, GQA 8/2,
vocab 8k, fp32, one torch thread) is served by ``prefill-worker serve`` once per configuration
(overlap on/off × chunk size 128/512). Requests arrive as a Poisson process at several rates
(fractions of the capacity measured in this run); prompt lengths are lognormal (median 256,
sigma 0.8, clipped to [16, 1536]). Every configuration gets the same prompts and arrival times.
The decode side is the reference ``DecodePeer`` with one new token (it only receives KV).

All four workers run at once (idle ones cost little) and the points go rate by rate, one
configuration after the other, so the drift of a shared machine's load hits every
configuration alike; saturation (the highest rate) runs twice per configuration and the
faster round counts. TTFT is router send → ``result`` (after the KV and first token have
landed). Low load is also probed closed loop: per prompt, its "pure forward" (the same chunked
prefill in this process, same model and threads), the request alone, the pure forward again;
``ttft_overhead_at_low_load`` is median(TTFT / best pure forward) - 1 over 12 prompts.
``transfer_gb_s`` is KV bytes over the post-prefill transfer time (earlier chunks travel
during prefill, so it is an effective rate). Writes one JSON line per configuration and rate,
then a summary, to stdout and ``bench/results/e2e.json``; plots ``bench/results/e2e.png``;
rewrites the table in README.md between its e2e markers.

Before the summary come the engine-loop stall lines (``bench/engine_stall.py``, issue 17): per
pool layout, the longest time one engine turn spent inside the transfer backend while
2048-token prompts were pushed (writes posted by the transfer thread; goal < 5 ms).

    python bench/e2e.py [--quick] [--stall-only]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import engine_stall  # noqa: E402

from prefill_worker.batch import BatchOutput, BatchPlan, ChunkPlan  # noqa: E402
from prefill_worker.ingress.client import RouterClient  # noqa: E402
from prefill_worker.kv.layout import KVLayout  # noqa: E402
from prefill_worker.model import Runner, build  # noqa: E402
from prefill_worker.model.kv_cache import KVCache  # noqa: E402
from prefill_worker.request import OutcomeStatus, SamplingParams, Timings  # noqa: E402
from prefill_worker.testing.decode_peer import DecodePeer  # noqa: E402
from prefill_worker.testing.launch import ChildProcess, free_port  # noqa: E402
from prefill_worker.transfer import describe_worker  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
PAGE_SIZE, NUM_PAGES = 16, 4096
CHUNK_SIZES = (512, 128)  # the first is the default the summary reports
RATE_FRACTIONS = (0.1, 0.4, 0.7, 1.0, 1.5)
README_BEGIN, README_END = "<!-- e2e:begin -->", "<!-- e2e:end -->"


@dataclass(frozen=True)
class Sample:
    num_tokens: int
    ttft_s: float
    is_ok: bool
    transfer_s: float
    done_at: float
    error: str | None
    timings: Timings


def write_lines(lines: Iterable[Mapping[str, object]], path: Path, *, append: bool = False) -> None:
    """Each result line as JSON to stdout and to ``path`` (replaced, or appended to: runs
    accumulate)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as out:
        for line in lines:
            print(json.dumps(line), flush=True)
            out.write(json.dumps(line) + "\n")


def make_checkpoint(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).save_pretrained(path)
    return path


def workload(num: int, rate: float, seed: int) -> list[tuple[float, int]]:
    """``num`` (arrival offset s, prompt length): Poisson arrivals, lognormal lengths."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(num):
        at += rng.expovariate(rate)
        out.append((at, min(1536, max(16, round(rng.lognormvariate(math.log(256), 0.8))))))
    return out


def forward_time(runner: Runner, num_tokens: int, chunk_size: int) -> float:
    """One prompt's chunked prefill alone, in this process: the "pure forward" time."""
    ids = [random.randrange(SHAPE["vocab_size"]) for _ in range(num_tokens)]
    pages = list(range(-(-num_tokens // PAGE_SIZE)))
    start = time.perf_counter()
    for begin in range(0, num_tokens, chunk_size):
        end = min(num_tokens, begin + chunk_size)
        sampling = SamplingParams() if end == num_tokens else None
        runner.run(BatchPlan(0, (ChunkPlan("f", ids[begin:end], begin, end, pages, sampling),)))
    return time.perf_counter() - start


class WorkerProcess:
    """``prefill-worker serve`` on the bench checkpoint; ready on its sd_notify READY=1."""

    def __init__(
        self,
        ckpt: Path,
        overlap: bool,
        chunk_size: int,
        workdir: Path,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        ports = [free_port() for _ in range(3)]
        self.ingress, self.bootstrap = (f"tcp://127.0.0.1:{p}" for p in ports[:2])
        settings = {
            "model.path": ckpt, "model.dtype": "float32", "model.attention_backend": "sdpa",
            "model.num_threads": 1, "cache.page_size": PAGE_SIZE, "cache.num_pages": NUM_PAGES,
            "cache.num_aux_rows": 1024, "scheduler.chunk_size": chunk_size,
            "scheduler.max_batch_tokens": 2048, "scheduler.max_running_requests": 64,
            "scheduler.overlap": str(overlap).lower(), "scheduler.bootstrap_timeout_s": 120,
            "scheduler.transfer_timeout_s": 120, "ingress.bind": self.ingress,
            "transfer.bootstrap_bind": self.bootstrap, "metrics.bind": f"127.0.0.1:{ports[2]}",
            "daemon.log_level": "warning",
        }  # fmt: skip
        settings.update(extra or {})
        args = [sys.executable, "-m", "prefill_worker", "serve", "configs/default.yaml"]
        for key, value in settings.items():
            args += ["--set", f"{key}={value}"]
        self.child = ChildProcess.start("worker", args, workdir, cwd=ROOT)
        self.child.wait_ready(300)

    @property
    def log_path(self) -> Path:
        return self.child.log_path

    def stop(self) -> int:
        return self.child.stop(120)


class _NoRunner:
    """The bench's decode peer asks for one new token: it never runs a forward."""

    def run(self, plan: BatchPlan) -> BatchOutput:
        raise AssertionError("the load generator's decode peer does not decode")


def decode_peer(bootstrap: str) -> DecodePeer:
    layout = KVLayout(
        SHAPE["num_hidden_layers"],
        SHAPE["num_key_value_heads"],
        64,
        "float32",
        PAGE_SIZE,
        NUM_PAGES,
        describe_worker(bootstrap, 60.0).kind,  # the worker's pool layout
    )
    kv_cache = KVCache(layout, torch.device("cpu"))
    return DecodePeer(_NoRunner(), kv_cache, bootstrap, num_aux_rows=1024, stop_token_ids=())


class Target:
    """One configuration under test: its worker, its decode peer, a router client."""

    def __init__(
        self,
        ckpt: Path,
        overlap: bool,
        chunk_size: int,
        workdir: Path,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """``extra``: more ``--set key=value`` settings for the worker."""
        self.overlap, self.chunk_size = overlap, chunk_size
        self.worker = WorkerProcess(ckpt, overlap, chunk_size, workdir, extra)
        self.peer = decode_peer(self.worker.bootstrap)
        self.router = RouterClient(self.worker.ingress)
        self._rng = random.Random(7)

    @property
    def name(self) -> str:
        return f"overlap={'on' if self.overlap else 'off'},chunk={self.chunk_size}"

    async def one(self, num_tokens: int) -> Sample:
        """One request: the decode peer is told the room, the worker gets the prompt."""
        ids = [self._rng.randrange(SHAPE["vocab_size"]) for _ in range(num_tokens)]
        room = self._rng.getrandbits(63)
        sent = time.monotonic()
        self.peer.expect(room, ids, 1)
        result = await self.router.prefill(ids, room, timeout_s=300)
        done = time.monotonic()
        is_ok = result.status is OutcomeStatus.OK
        t = result.timings
        return Sample(num_tokens, done - sent, is_ok, t.transfer_s, done, result.error, t)

    async def run_point(self, load: list[tuple[float, int]]) -> list[Sample]:
        """The workload on its schedule; ``done_at`` relative to the start."""
        start, tasks = time.monotonic(), []
        for offset, n in load:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.ensure_future(self.one(n)))
        samples = await asyncio.gather(*tasks)
        return [dataclasses.replace(s, done_at=s.done_at - start) for s in samples]

    def close(self) -> None:
        self.router.close()
        self.peer.close()
        code = self.worker.stop()
        assert code == 0, f"worker exited with {code}; log: {self.worker.log_path}"


async def pump(peers: list[DecodePeer], stop: asyncio.Event) -> None:
    """Every decode peer's receiver driven every ~2 ms for the whole run (heartbeats too)."""
    while not stop.is_set():
        for peer in peers:
            peer.step()
        await asyncio.sleep(0.002)


def point_line(overlap: bool, chunk: int, rate: float, samples: list[Sample]) -> dict[str, object]:
    ok = [s for s in samples if s.is_ok]
    ttfts = sorted(s.ttft_s for s in ok)
    kv_bytes = sum(_kv_bytes(s.num_tokens) for s in ok)
    return {
        "name": "e2e",
        "overlap": overlap,
        "chunk_size": chunk,
        "rate": round(rate, 3),
        "ttft_p50_s": round(_quantile(ttfts, 0.5), 4),
        "ttft_p99_s": round(_quantile(ttfts, 0.99), 4),
        "prefill_tok_s": round(_tok_s(samples), 1),
        "transfer_gb_s": round(kv_bytes / max(1e-9, sum(s.transfer_s for s in ok)) / 1e9, 3),
        "num_requests": len(samples),
        "num_failed": len(samples) - len(ok),
    }


def _kv_bytes(num_tokens: int) -> int:
    page_bytes = PAGE_SIZE * SHAPE["num_key_value_heads"] * 64 * 4
    return -(-num_tokens // PAGE_SIZE) * page_bytes * 2 * SHAPE["num_hidden_layers"]


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else math.nan


@dataclass(frozen=True)
class Probe:
    """One request alone on an idle worker, with the same prompt's pure forward around it."""

    sample: Sample
    pure_forward_s: float  # best of the in-process forward just before and just after

    @property
    def overhead(self) -> float:
        return self.sample.ttft_s / self.pure_forward_s - 1.0


async def probe(target: Target, runner: Runner, lengths: list[int]) -> list[Probe]:
    """Low load, measured closed loop: forward, request, forward, per prompt. Times next to
    each other share the machine's background load, which drifts over a run."""
    probes = []
    for n in lengths:
        before = forward_time(runner, n, target.chunk_size)
        sample = await target.one(n)
        after = forward_time(runner, n, target.chunk_size)
        probes.append(Probe(sample, min(before, after)))
    return probes


async def run_all(
    ckpt: Path, runner: Runner, rates: list[float], loads: list[list[tuple[float, int]]], tmp: Path
) -> tuple[dict[str, dict[float, list[Sample]]], dict[str, list[Probe]]]:
    """Every configuration's worker up at once; points run rate by rate, configuration by
    configuration, so slow drift in the machine's load hits all of them alike. Saturation runs
    twice (second round in reverse order); the faster round of each configuration is kept."""
    targets = [Target(ckpt, o, c, tmp) for c in CHUNK_SIZES for o in (True, False)]
    stop = asyncio.Event()
    pumper = asyncio.ensure_future(pump([t.peer for t in targets], stop))
    runs: dict[str, dict[float, list[Sample]]] = {t.name: {} for t in targets}
    try:
        for target in targets:
            await target.run_point([(0.0, 64), (0.05, 512)])  # warm-up
        probes = {t.name: await probe(t, runner, [n for _, n in loads[0]][:12]) for t in targets}
        for rate, load in zip(rates, loads, strict=True):
            for round_ in range(2 if rate == rates[-1] else 1):
                for target in targets if round_ == 0 else targets[::-1]:
                    samples = await target.run_point(load)
                    _progress(target, rate, samples)
                    kept = runs[target.name].get(rate)
                    if kept is None or _tok_s(samples) > _tok_s(kept):
                        runs[target.name][rate] = samples
    finally:
        stop.set()
        await pumper
        for target in targets:
            target.close()
    return runs, probes


def _progress(target: Target, rate: float, samples: list[Sample]) -> None:
    failed = sorted({str(s.error) for s in samples if not s.is_ok})
    print(
        f"# {target.name} rate={rate:.2f}/s: {len(samples)} requests, {_tok_s(samples):.0f}"
        f" tok/s, {len(failed)} distinct failures {failed[:2]}",
        file=sys.stderr,
        flush=True,
    )


def _tok_s(samples: list[Sample]) -> float:
    ok = [s for s in samples if s.is_ok]
    return sum(s.num_tokens for s in ok) / max((s.done_at for s in ok), default=math.inf)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per point")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md alone")
    parser.add_argument("--stall-only", action="store_true", help="only the engine-loop stall")
    args = parser.parse_args()
    stall_lines = engine_stall.lines(3 if args.quick else 6)
    if args.stall_only:
        for line in stall_lines:
            print(json.dumps(line), flush=True)
        return 0
    duration_s, min_n, max_n = (4.0, 8, 30) if args.quick else (12.0, 20, 120)
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = make_checkpoint(tmp / "ckpt")
        runner, _, _ = build(ckpt, "float32", "cpu", "sdpa", PAGE_SIZE, 128, num_threads=1)
        forward_time(runner, 64, 64)  # warm-up
        calib = [n for _, n in workload(24, 1.0, seed=1)]
        pure_s = sum(forward_time(runner, n, CHUNK_SIZES[0]) for n in calib)
        capacity_req_s = sum(calib) / pure_s / statistics.mean(calib)
        rates = [f * capacity_req_s for f in RATE_FRACTIONS]
        loads = [
            workload(min(max_n, max(min_n, round(rate * duration_s))), rate, seed=100 + i)
            for i, rate in enumerate(rates)
        ]
        runs, probes = asyncio.run(run_all(ckpt, runner, rates, loads, tmp))
    lines: list[dict[str, object]] = []
    for name, by_rate in runs.items():
        overlap, chunk = name.startswith("overlap=on"), int(name.rsplit("=", 1)[1])
        lines += [point_line(overlap, chunk, rate, samples) for rate, samples in by_rate.items()]
    lines += stall_lines
    lines.append(summary(runs, probes, rates, capacity_req_s))
    write_lines(lines, RESULTS / "e2e.json")
    plot(lines, RESULTS / "e2e.png")
    if not args.no_readme:
        update_readme(lines, ROOT / "README.md")
    return 0


def summary(
    runs: dict[str, dict[float, list[Sample]]],
    probes: dict[str, list[Probe]],
    rates: list[float],
    capacity_req_s: float,
) -> dict[str, object]:
    def speedup(chunk: int) -> float:
        on, off = (runs[f"overlap={o},chunk={chunk}"][rates[-1]] for o in ("on", "off"))
        return _tok_s(on) / _tok_s(off)

    overhead = {
        name: round(statistics.median(p.overhead for p in mine if p.sample.is_ok), 3)
        for name, mine in probes.items()
    }
    default = f"overlap=on,chunk={CHUNK_SIZES[0]}"
    low = [p for p in probes[default] if p.sample.is_ok]
    breakdown = {  # medians of the default configuration's probes: where TTFT goes
        "ttft": statistics.median(p.sample.ttft_s for p in low),
        "pure_forward": statistics.median(p.pure_forward_s for p in low),
        "worker_queue": statistics.median(p.sample.timings.queue_s for p in low),
        "worker_bootstrap": statistics.median(p.sample.timings.bootstrap_s for p in low),
        "worker_prefill": statistics.median(p.sample.timings.prefill_s for p in low),
        "worker_transfer": statistics.median(p.sample.timings.transfer_s for p in low),
        "outside_worker": statistics.median(
            p.sample.ttft_s - _worker_s(p.sample.timings) for p in low
        ),
    }
    return {
        "name": "e2e_summary",
        "overlap_speedup_at_saturation": round(speedup(CHUNK_SIZES[0]), 3),
        "ttft_overhead_at_low_load": overhead[default],
        "overlap_speedup_by_chunk": {str(c): round(speedup(c), 3) for c in CHUNK_SIZES},
        "ttft_overhead_by_config": overhead,
        "capacity_req_s": round(capacity_req_s, 2),
        "low_load_breakdown_p50_s": {k: round(v, 4) for k, v in breakdown.items()},
    }


def _worker_s(t: Timings) -> float:
    return t.queue_s + t.bootstrap_s + t.prefill_s + t.transfer_s


def plot(lines: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [line for line in lines if line["name"] == "e2e"]
    configs = sorted({(p["overlap"], p["chunk_size"]) for p in points}, key=str)
    for i, (overlap, chunk) in enumerate(configs):
        mine = [p for p in points if (p["overlap"], p["chunk_size"]) == (overlap, chunk)]
        rates = [float(p["rate"]) for p in mine]  # type: ignore[arg-type]
        label = f"overlap {'on' if overlap else 'off'}, chunk {chunk}"
        color = f"C{i}"
        ax.plot(rates, [p["ttft_p50_s"] for p in mine], "o-", color=color, label=f"{label} p50")
        ax.plot(rates, [p["ttft_p99_s"] for p in mine], "x--", color=color, label=f"{label} p99")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title("prefill-worker end to end: TTFT vs offered load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def update_readme(lines: list[dict[str, object]], path: Path) -> None:
    """Replace the table between the e2e markers (left alone when the markers are absent)."""
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        return
    rows = [
        "| overlap | chunk | rate (req/s) | TTFT p50 (s) | TTFT p99 (s) | prefill tok/s | "
        "transfer GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in (line for line in lines if line["name"] == "e2e"):
        rows.append(
            f"| {'on' if p['overlap'] else 'off'} | {p['chunk_size']} | {p['rate']} | "
            f"{p['ttft_p50_s']} | {p['ttft_p99_s']} | {p['prefill_tok_s']} | "
            f"{p['transfer_gb_s']} |"
        )
    summ = lines[-1]
    rows += [
        "",
        f"Overlap speedup at saturation: **{summ['overlap_speedup_at_saturation']}** "
        f"(by chunk size: {summ['overlap_speedup_by_chunk']}); TTFT overhead at low load: "
        f"**{summ['ttft_overhead_at_low_load']}** (by configuration: "
        f"{summ['ttft_overhead_by_config']}).",
    ]
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_BEGIN}\n{chr(10).join(rows)}\n{README_END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
