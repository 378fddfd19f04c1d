"""Tensor parallelism's cost: TP N rank processes against TP 1, same model, same prompts.

One run, on a random checkpoint of a real model's shapes (CPU: Qwen2-0.5B, fp32; CUDA:
Llama-3-8B, bf16, whose 32 heads and 8 KV heads split at TP 2, 4 and 8) and prompts of 2048
tokens, prefilled by the worker's own runner (``model.build(..., tp=TPGroup(...))``)::

    CPU   TP 1: one process, 2 threads       against   TP 2: two rank processes, 1 thread
          each, a gloo group on 127.0.0.1                (the same two cores either way)
    CUDA  TP 1: one process on cuda:0        against   TP N: N rank processes, cuda:r, NCCL,
          for every N in 2, 4, 8 that the host has devices for

Every process builds the model once, runs a warm-up forward, then the parent steps the
configurations in turn (TP 1 once, TP N once, ...; ``--repeats`` rounds), so a noisy
neighbour hurts both sides alike; the best round of each counts. A TP N round is timed from
a barrier to the slowest rank's end. Each rank also times its ``all_reduce`` calls (it
wraps ``torch.distributed.all_reduce``, which ``model.parallel`` calls; on CUDA by events on
the stream, with no extra sync): ``collective_share`` is that time over the rank's forward
time, averaged over the ranks of the best round. Every wait has a deadline; a process left alive
at the end is killed. Prints, and appends to ``bench/results/tp.json``, one JSON line per TP
size::

    {"name": "tp", "tp": 2, "tokens_per_s": ..., "tp1_tokens_per_s": ..., "ratio": ...,
     "collective_share": ..., "device": "cpu", "efficiency": ...}

``ratio`` is TP N's throughput over TP 1's; ``efficiency`` is ``ratio / N`` on CUDA (N
devices against one) and ``ratio`` on CPU (the same cores). Goal on a 2-core CPU: ratio
>= 0.85. Compare within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import TPGroup, build
from prefill_worker.model.hf_config import read_spec
from prefill_worker.model.loader import INDEX_FILE, expected_shapes
from prefill_worker.request import SamplingParams
from prefill_worker.testing.launch import free_port

RESULTS = Path(__file__).resolve().parent / "results"
PAGE_SIZE = 16
SHARD_BYTES = 1 << 30
# config.json of each shape; weights are random (std 0.02, norms 1).
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "use_sliding_window": False,
}  # fmt: skip
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "hidden_act": "silu",
}  # fmt: skip
SHAPES = {"qwen2-0.5b": QWEN2_05B, "llama3-8b": LLAMA3_8B}


@dataclass(frozen=True, slots=True)
class Setup:
    """What every process of the run needs (picklable: it crosses the spawn)."""

    checkpoint: str
    device: str  # "cpu" | "cuda"
    dtype: str
    prompt_tokens: int
    num_prompts: int
    num_threads: int  # torch threads of this configuration's process(es)


def make_checkpoint(config: dict[str, object], path: Path, dtype: torch.dtype) -> None:
    """A random checkpoint with exactly the tensors the loader expects for ``config``."""
    (path / "config.json").write_text(json.dumps(config | {"torch_dtype": str(dtype)[6:]}))
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(read_spec(path)).items():
        is_norm = name.endswith("norm.weight")
        tensor = torch.ones(shape) if is_norm else torch.randn(shape, generator=gen) * 0.02
        shard[name] = tensor.to(dtype)
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            _save_shard(path, shard, weight_map)
    _save_shard(path, shard, weight_map)
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


def _save_shard(path: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str]) -> None:
    file = f"model-{len(set(weight_map.values())):05d}.safetensors"
    save_file(shard, str(path / file))
    weight_map |= dict.fromkeys(shard, file)
    shard.clear()


def prompt_plan(setup: Setup, vocab: int) -> BatchPlan:
    """``num_prompts`` random prompts of ``prompt_tokens``, whole, on their own pages."""
    gen = torch.Generator().manual_seed(1)
    pages_each = -(-setup.prompt_tokens // PAGE_SIZE)
    chunks = []
    for i in range(setup.num_prompts):
        ids = torch.randint(0, vocab, (setup.prompt_tokens,), generator=gen).tolist()
        pages = list(range(i * pages_each, (i + 1) * pages_each))
        chunks.append(ChunkPlan(f"p{i}", ids, 0, len(ids), pages, SamplingParams()))
    return BatchPlan(0, tuple(chunks))


class CollectiveClock:
    """Wraps ``torch.distributed.all_reduce`` in this process and sums its time: wall time
    on CPU (gloo returns when the sum is done), CUDA events around it on the stream on CUDA
    (NCCL's kernel, waits for the peers included, with no sync to perturb the forward)."""

    def __init__(self, is_cuda: bool) -> None:
        self._is_cuda, self._all_reduce = is_cuda, torch.distributed.all_reduce
        self._cpu_s, self._events = 0.0, list[tuple[torch.cuda.Event, torch.cuda.Event]]()
        torch.distributed.all_reduce = self._timed

    def _timed(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._all_reduce(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        began = time.perf_counter()
        out = self._all_reduce(*args, **kwargs)
        self._cpu_s += time.perf_counter() - began
        return out

    def take_seconds(self) -> float:
        """The time summed since the last call (on CUDA: after a device sync)."""
        seconds = self._cpu_s + sum(s.elapsed_time(e) for s, e in self._events) / 1000
        self._cpu_s, self._events = 0.0, []
        return seconds


def _worker(setup: Setup, rank: int, size: int, port: int, conn: Connection) -> None:
    """One process of one configuration: build, warm up, then one timed forward per
    ``"run"`` received, answering ``(forward_s, collective_s)``; ``"stop"`` ends it."""
    torch.set_num_threads(setup.num_threads)
    device = f"cuda:{rank}" if setup.device == "cuda" else "cpu"
    is_cuda = setup.device == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if is_cuda else (lambda: None)
    tp = TPGroup()
    if size > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        if is_cuda:
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(
            "nccl" if is_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
            rank=rank, world_size=size, timeout=timedelta(seconds=120),
        )  # fmt: skip
        tp = TPGroup(rank, size, torch.distributed.group.WORLD)
    pages = setup.num_prompts * -(-setup.prompt_tokens // PAGE_SIZE)
    runner, _, info = build(
        setup.checkpoint, setup.dtype, device, page_size=PAGE_SIZE, num_pages=pages, tp=tp
    )
    plan = prompt_plan(setup, info.vocab_size)
    clock = CollectiveClock(is_cuda) if size > 1 else None
    runner.run(plan)  # warm-up
    conn.send("ready")
    while conn.recv() == "run":
        if size > 1:
            torch.distributed.barrier()
        sync()
        if clock:
            clock.take_seconds()  # drop the warm-up's and the barrier's
        start = time.perf_counter()
        runner.run(plan)  # its end syncs the device
        sync()
        forward_s = time.perf_counter() - start
        conn.send((forward_s, clock.take_seconds() if clock else 0.0))
    if size > 1:
        torch.distributed.destroy_process_group()


class Group:
    """The ``size`` rank processes of one configuration, driven over pipes: each runs
    ``worker(*args(rank, port, conn))`` (``port`` the group's rendezvous, ``conn`` its pipe),
    answers "ready", then one (seconds, collective seconds) per message until "stop".
    ``bench/ep.py`` drives its configurations with it too."""

    def __init__(
        self,
        size: int,
        worker: Callable[..., None],
        args: Callable[[int, int, Connection], tuple[Any, ...]],
        deadline: float,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.deadline, self.conns, self.processes = deadline, [], []
        port = free_port()
        for rank in range(size):
            parent, child = context.Pipe()
            process = context.Process(target=worker, args=args(rank, port, child))
            process.start()
            self.conns.append(parent)
            self.processes.append(process)

    def wait_ready(self) -> None:
        assert self._receive() == ["ready"] * len(self.conns)

    def round(self, message: object = "run") -> tuple[float, float]:
        """One timed forward (``message`` tells the ranks which): (slowest rank's seconds,
        mean collective share)."""
        for conn in self.conns:
            conn.send(message)
        times = self._receive()
        return max(t for t, _ in times), sum(c / t for t, c in times) / len(times)

    def _receive(self) -> list[Any]:
        answers = []
        for conn, process in zip(self.conns, self.processes, strict=True):
            if not conn.poll(max(0.0, self.deadline - time.monotonic())):
                raise TimeoutError(f"{process.name}: no answer before the deadline")
            answers.append(conn.recv())
        return answers

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone: the join below kills or reaps it
                conn.send("stop")
        for process in self.processes:
            process.join(max(1.0, self.deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(10)


def _tp_group(setup: Setup, size: int, deadline: float) -> Group:
    return Group(size, _worker, lambda rank, port, conn: (setup, rank, size, port, conn), deadline)


def measure(
    setup: Setup, sizes: list[int], repeats: int, deadline: float
) -> list[dict[str, object]]:
    ranked = {size: dataclasses.replace(setup, num_threads=_rank_threads(setup, size))
              for size in sizes}  # fmt: skip
    groups: dict[int, Group] = {}
    try:
        groups[1] = _tp_group(setup, 1, deadline)
        groups[1].wait_ready()  # one at a time: loading is memory- and CPU-bound
        for size in sizes:
            groups[size] = _tp_group(ranked[size], size, deadline)
            groups[size].wait_ready()
        best: dict[int, tuple[float, float]] = {}
        for _ in range(repeats):
            for size, group in groups.items():
                seconds, share = group.round()
                if size not in best or seconds < best[size][0]:
                    best[size] = (seconds, share)
    finally:
        for group in groups.values():
            group.close()
    return [_row(setup, size, best[size], best[1][0]) for size in sizes]


def _rank_threads(setup: Setup, size: int) -> int:
    """The TP 1 process's threads shared out over the ranks (CPU); 1 per rank (CUDA)."""
    return max(1, setup.num_threads // size) if setup.device == "cpu" else 1


def _row(setup: Setup, size: int, best: tuple[float, float], tp1_s: float) -> dict[str, object]:
    tokens = setup.num_prompts * setup.prompt_tokens
    ratio = tp1_s / best[0]
    return {
        "name": "tp",
        "tp": size,
        "tokens_per_s": round(tokens / best[0], 1),
        "tp1_tokens_per_s": round(tokens / tp1_s, 1),
        "ratio": round(ratio, 3),
        "collective_share": round(best[1], 3),
        "device": setup.device,
        "efficiency": round(ratio / size if setup.device == "cuda" else ratio, 3),
        "dtype": setup.dtype,
        "tokens": tokens,
    }


def tp_sizes(device: str, config: dict[str, object]) -> list[int]:
    """CPU: TP 2. CUDA: 2, 4, 8 up to the device count, where the heads split."""
    if device == "cpu":
        return [2]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    assert isinstance(heads, int) and isinstance(kv, int)
    count = torch.cuda.device_count()
    return [n for n in (2, 4, 8) if n <= count and heads % n == 0 and (kv % n == 0 or n % kv == 0)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=list(SHAPES), help="default: per device (above)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, help="default: 1 on CPU, 8 on CUDA")
    parser.add_argument("--threads", type=int, default=2, help="TP 1's threads (CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "tp.json", help="appended to")
    args = parser.parse_args()
    is_cpu = args.device == "cpu"
    config = SHAPES[args.shape or ("qwen2-0.5b" if is_cpu else "llama3-8b")]
    dtype = "float32" if is_cpu else "bfloat16"
    sizes = tp_sizes(args.device, config)
    if not sizes:
        print(f"no TP size fits {torch.cuda.device_count()} devices", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.deadline_s
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        make_checkpoint(config, Path(tmp), getattr(torch, dtype))
        setup = Setup(tmp, args.device, dtype, args.prompt_tokens,
                      args.num_prompts or (1 if is_cpu else 8), args.threads)  # fmt: skip
        rows = measure(setup, sizes, args.repeats, deadline)
    with args.out.open("a") as out:
        for row in rows:
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0 if all(math.isfinite(float(str(r["ratio"]))) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
