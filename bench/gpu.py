"""The GPU numbers: prefill MFU of an 8B-shaped Llama, and a VRAM→VRAM NIXL push.

    python bench/gpu.py [--out bench/results/gpu.json]      # on a CUDA machine
    python bench/gpu.py --dry-run                           # tiny shapes on CPU: the plumbing

Prefill: a random Llama-3-8B-shaped model (``prefill_worker.testing.random_model``, bf16,
flashinfer when importable, else sdpa) runs one prompt of 1k, 4k and 16k tokens through our
runner; the best of a few timed runs after warm-up. FLOPs count every GEMM (2 · params · T)
plus causal attention (2 · layers · heads · head_dim · T², i.e. QKᵀ and PV over half the
square); MFU divides by the device's dense bf16 peak (``--peak-tflops``, H200: 989).

Transfer: a second process owns a destination buffer registered with its own NIXL agent;
this one WRITEs a same-sized source into it (one descriptor, VRAM→VRAM on the same GPU),
then the child checks every byte. The baseline is a same-device ``copy_`` (cudaMemcpy D2D)
of the same size in this process.

Writes JSON lines (and prints them)::

    {"name": "gpu_prefill", "tokens": ..., "tok_s": ..., "mfu": ..., "backend": ..., ...}
    {"name": "gpu_transfer", "bytes": ..., "gb_s": ..., "ratio_to_cudamemcpy": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefill_worker.batch import BatchPlan, ChunkPlan  # noqa: E402
from prefill_worker.model.hf_config import ModelSpec  # noqa: E402
from prefill_worker.request import SamplingParams  # noqa: E402
from prefill_worker.testing.random_model import LLAMA3_8B, random_runner  # noqa: E402

PAGE_SIZE = 16
TINY = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}  # fmt: skip


def forward_flops(spec: ModelSpec, tokens: int) -> float:
    """FLOPs of one prefill of ``tokens`` tokens that samples one row (see the docstring)."""
    h, hd = spec.hidden_size, spec.head_dim
    qkv = h * (spec.num_heads + 2 * spec.num_kv_heads) * hd
    per_layer = qkv + spec.num_heads * hd * h + 3 * h * spec.intermediate_size
    gemm = 2 * tokens * spec.num_layers * per_layer + 2 * h * spec.vocab_size
    attention = 2 * spec.num_layers * spec.num_heads * hd * tokens * tokens
    return float(gemm + attention)


def best_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: kernels compiled or tuned, workspaces allocated
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def prefill_lines(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    config, dtype = (TINY, torch.float32) if args.dry_run else (LLAMA3_8B, torch.bfloat16)
    backend = "sdpa" if args.dry_run or not _has_flashinfer() else "flashinfer"
    longest = max(args.tokens)
    runner, spec = random_runner(config, dtype, device, backend, PAGE_SIZE, longest // PAGE_SIZE)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    lines = []
    for tokens in args.tokens:
        ids = torch.randint(0, spec.vocab_size, (tokens,)).tolist()
        pages = list(range(-(-tokens // PAGE_SIZE)))
        plan = BatchPlan(0, (ChunkPlan("bench", ids, 0, tokens, pages, SamplingParams()),))
        seconds = best_seconds(lambda plan=plan: runner.run(plan), sync, args.repeats)
        flops = forward_flops(spec, tokens)
        lines.append(
            {
                "name": "gpu_prefill",
                "tokens": tokens,
                "tok_s": round(tokens / seconds, 1),
                "mfu": round(flops / seconds / (args.peak_tflops * 1e12), 4),
                "seconds": round(seconds, 5),
                "tflops": round(flops / seconds / 1e12, 2),
                "backend": backend,
                "dtype": str(dtype).removeprefix("torch."),
                "device": _device_name(device),
            }
        )
        print(json.dumps(lines[-1]), flush=True)
    return lines


def transfer_line(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from prefill_worker.transfer.nixl.agent import make_agent

    size = args.transfer_bytes
    src = _pattern(size, device)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, size, str(device)), daemon=True)
    proc.start()
    try:
        metadata, remote = parent.recv()
        agent = make_agent("bench-src", ["UCX"])
        agent.register_memory(agent.get_reg_descs([src]))
        name = agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        local = agent.get_xfer_descs([src])
        remote_descs = agent.get_xfer_descs([remote], _mem(device))

        def push() -> None:
            handle = agent.initialize_xfer("WRITE", local, remote_descs, name)
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError("NIXL WRITE failed")

        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        seconds = best_seconds(push, sync, args.repeats)
        parent.send("check")
        is_exact = parent.recv()
        dst = torch.empty_like(src)
        memcpy_s = best_seconds(lambda: dst.copy_(src), sync, args.repeats)
    finally:
        parent.send("stop")
        proc.join(30)
    line = {
        "name": "gpu_transfer",
        "bytes": size,
        "gb_s": round(size / seconds / 1e9, 2),
        "memcpy_gb_s": round(size / memcpy_s / 1e9, 2),
        "ratio_to_cudamemcpy": round(memcpy_s / seconds, 3),
        "byte_exact": is_exact,
        "mem": _mem(device),
        "device": _device_name(device),
    }
    print(json.dumps(line), flush=True)
    return line


def _receiver(conn: Connection, size: int, device_name: str) -> None:
    """The other process: a destination buffer, its agent, then a byte check on request."""
    from prefill_worker.transfer.nixl.agent import make_agent

    device = torch.device(device_name)
    dst = torch.zeros(size, dtype=torch.uint8, device=device)
    agent = make_agent("bench-dst", ["UCX"])
    agent.register_memory(agent.get_reg_descs([dst]))
    conn.send((agent.get_agent_metadata(), (dst.data_ptr(), size, _device_id(device))))
    while True:  # progress thread off: this loop drives UCX (wire-up) between commands
        agent.get_new_notifs()
        if not conn.poll(0.001):
            continue
        command = conn.recv()
        if command == "stop":
            return
        conn.send(bool(torch.equal(dst, _pattern(size, device))))


def _pattern(size: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(7)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def _mem(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def _device_id(device: torch.device) -> int:
    return device.index or 0 if device.type == "cuda" else 0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _has_flashinfer() -> bool:
    """Importable, not only installed: a carried flashinfer may lack a dependency there."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a missing CUDA piece at import
        print(f"flashinfer does not import ({exc}); measuring sdpa", file=sys.stderr)
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", type=Path, help="JSON lines file (default: results/gpu.json)")
    parser.add_argument("--tokens", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    parser.add_argument("--transfer-bytes", type=int)
    args = parser.parse_args()
    if args.dry_run:
        device = torch.device("cpu")
        args.tokens = args.tokens or [64, 128]
        args.transfer_bytes = args.transfer_bytes or 1 << 20
        args.repeats = 1
    elif not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        args.tokens = args.tokens or [1024, 4096, 16384]
        args.transfer_bytes = args.transfer_bytes or 1 << 30
    out = args.out or (
        Path("/tmp/gpu-dry-run.json") if args.dry_run else ROOT / "bench/results/gpu.json"
    )
    lines = prefill_lines(args, device)
    lines.append(transfer_line(args, device))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0 if lines[-1]["byte_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
