"""Prefix cache on against off, on multi-turn chats: this process plays router and decode.

Two ``prefill-worker serve`` processes run the same random Llama (bench/e2e.py's shape: hidden
512, 4 layers, GQA 8/2, vocab 8k; fp32, one torch thread, CPU), one with the prefix cache on
(the default) and one with ``cache.prefix_caching=false``. Each has a reference
``DecodePeer`` that receives the KV and the first token (one new token, no decoding).

Workload, per shared fraction ``f``: 8 conversations of 4 turns. Turn ``k``'s prompt is turn
``k-1``'s prompt followed by new tokens (the assistant's reply and the next user message), so
that ``f`` of it is a prefix an earlier request sent: lengths 432, 576, 768, 1024 at f = 0.75.
Turn 0 opens each conversation (not measured); turns 1-3 are. The control, f = 0, sends the
same lengths with fresh tokens every time. Requests go one at a time (closed loop: TTFT
without queueing), each to both workers, alternating which goes first, so the machine's
drifting background load hits both alike. TTFT is router send → ``result`` (the KV and first
token have landed at the decode peer). ``hit_rate`` is the cache-on worker's
``num_prefix_hit_tokens / num_prompt_tokens`` over the measured requests; ``speedup`` is
TTFT p50 off / on. The pool (1024 pages of 16) is smaller than the control's tokens, so the
cache-on worker evicts during the control. ``speedup_paired_p50`` is the median of each
prompt's off/on ratio (its two requests ran back to back). Prints one JSON line per fraction
and writes them to ``bench/results/prefix_cache.json``:

    python bench/prefix_cache.py
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from prefill_worker.batch import BatchOutput, BatchPlan  # noqa: E402
from prefill_worker.ingress.client import RouterClient  # noqa: E402
from prefill_worker.kv.layout import KVLayout  # noqa: E402
from prefill_worker.model.kv_cache import KVCache  # noqa: E402
from prefill_worker.request import OutcomeStatus  # noqa: E402
from prefill_worker.testing.decode_peer import DecodePeer  # noqa: E402
from prefill_worker.testing.launch import ChildProcess, free_port  # noqa: E402

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
PAGE_SIZE, NUM_PAGES, HEAD_DIM = 16, 1024, 64
FRACTIONS = (0.75, 0.0)
NUM_CONVERSATIONS, FIRST_TURN_TOKENS, NUM_TURNS = 8, 432, 4
GOALS = {0.75: 2.5, 0.0: 0.97}  # speedup at least


def make_checkpoint(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).save_pretrained(path)
    return path


def conversations(fraction: float, seed: int) -> list[list[list[int]]]:
    """Per conversation, its turns' prompts; turn k shares ``fraction`` of itself with k-1."""
    rng = random.Random(seed)
    lengths = [round(FIRST_TURN_TOKENS * (4 / 3) ** k) for k in range(NUM_TURNS)]
    out = []
    for _ in range(NUM_CONVERSATIONS):
        turns: list[list[int]] = []
        for length in lengths:
            shared = turns[-1] if turns and fraction > 0 else []
            assert not shared or abs(len(shared) / length - fraction) < 0.01
            turns.append(
                [
                    *shared,
                    *(rng.randrange(SHAPE["vocab_size"]) for _ in range(length - len(shared))),
                ]
            )
        out.append(turns)
    return out


class _NoRunner:
    """The decode peer asks for one new token: it never runs a forward."""

    def run(self, plan: BatchPlan) -> BatchOutput:
        raise AssertionError("the bench's decode peer does not decode")


@dataclass
class Target:
    """One worker process, its decode peer and a router client."""

    name: str
    child: ChildProcess
    peer: DecodePeer
    router: RouterClient

    @classmethod
    def start(cls, name: str, ckpt: Path, workdir: Path, prefix_caching: bool) -> Target:
        ports = [free_port() for _ in range(3)]
        ingress, bootstrap = (f"tcp://127.0.0.1:{p}" for p in ports[:2])
        settings = {
            "model.path": ckpt, "model.dtype": "float32", "model.attention_backend": "sdpa",
            "model.num_threads": 1, "cache.page_size": PAGE_SIZE, "cache.num_pages": NUM_PAGES,
            "cache.prefix_caching": str(prefix_caching).lower(), "scheduler.chunk_size": 512,
            "scheduler.max_batch_tokens": 2048, "ingress.bind": ingress,
            "transfer.bootstrap_bind": bootstrap, "metrics.bind": f"127.0.0.1:{ports[2]}",
            "daemon.log_level": "warning",
        }  # fmt: skip
        args = [sys.executable, "-m", "prefill_worker", "serve", "configs/default.yaml"]
        for key, value in settings.items():
            args += ["--set", f"{key}={value}"]
        child = ChildProcess.start(name, args, workdir, cwd=ROOT)
        child.wait_ready(300)
        layout = KVLayout(
            SHAPE["num_hidden_layers"],
            SHAPE["num_key_value_heads"],
            HEAD_DIM,
            "float32",
            PAGE_SIZE,
            NUM_PAGES,
        )
        kv_cache = KVCache(layout, torch.device("cpu"))
        peer = DecodePeer(_NoRunner(), kv_cache, bootstrap, num_aux_rows=64, stop_token_ids=())
        return cls(name, child, peer, RouterClient(ingress))

    async def one(self, ids: list[int], room: int) -> tuple[float, int]:
        """TTFT of one request, and its prefix-cache hit in tokens."""
        sent = time.monotonic()
        self.peer.expect(room, ids, 1)
        result = await self.router.prefill(ids, room, timeout_s=300)
        ttft = time.monotonic() - sent
        assert result.status is OutcomeStatus.OK, result
        hit = result.num_prefix_hit_tokens
        return ttft, hit if isinstance(hit, int) else 0

    def close(self) -> None:
        self.router.close()
        self.peer.close()
        code = self.child.stop(120)
        assert code == 0, f"{self.name} exited with {code}; log: {self.child.log_path}"


async def pump(peers: list[DecodePeer], stop: asyncio.Event) -> None:
    """The decode peers' receivers driven every ~2 ms for the whole run (heartbeats too)."""
    while not stop.is_set():
        for peer in peers:
            peer.step()
        await asyncio.sleep(0.002)


async def measure(on: Target, off: Target, fraction: float, rooms: random.Random) -> dict:
    chats = conversations(fraction, seed=int(fraction * 100) + 1)
    for turns in chats:  # each conversation's opening turn: not measured
        for target in (on, off):
            await target.one(turns[0], rooms.getrandbits(63))
    ttft: dict[str, list[float]] = {"on": [], "off": []}  # in send order: pairs line up
    num_hit = num_prompt = 0
    for turn in range(1, NUM_TURNS):
        for i, turns in enumerate(chats):
            order = (on, off) if (turn + i) % 2 else (off, on)
            for target in order:
                seconds, hit = await target.one(turns[turn], rooms.getrandbits(63))
                ttft[target.name].append(seconds)
                if target is on:
                    num_hit, num_prompt = num_hit + hit, num_prompt + len(turns[turn])
    p50_on, p50_off = statistics.median(ttft["on"]), statistics.median(ttft["off"])
    speedup = p50_off / p50_on
    return {
        "name": "prefix_cache",
        "shared_fraction": fraction,
        "speedup": round(speedup, 3),
        "hit_rate": round(num_hit / num_prompt, 4),
        "ttft_p50_on_s": round(p50_on, 4),
        "ttft_p50_off_s": round(p50_off, 4),
        "speedup_paired_p50": round(
            statistics.median(a / b for a, b in zip(ttft["off"], ttft["on"], strict=True)), 3
        ),  # per prompt, off / on back to back: less exposed to a shared machine's drift
        "num_requests": len(ttft["on"]),
        "goal_speedup": GOALS[fraction],
        "meets_goal": speedup >= GOALS[fraction],
    }


async def run(ckpt: Path, workdir: Path) -> list[dict]:
    on = Target.start("on", ckpt, workdir, prefix_caching=True)
    off = Target.start("off", ckpt, workdir, prefix_caching=False)
    stop = asyncio.Event()
    pumper = asyncio.ensure_future(pump([on.peer, off.peer], stop))
    rooms = random.Random(7)
    try:
        for target in (on, off):  # warm-up: first forwards, allocations
            for n in (64, 512):
                ids = [rooms.randrange(SHAPE["vocab_size"]) for _ in range(n)]
                await target.one(ids, rooms.getrandbits(63))
        return [await measure(on, off, fraction, rooms) for fraction in FRACTIONS]
    finally:
        stop.set()
        await pumper
        on.close()
        off.close()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp_name:
        tmp = Path(tmp_name)
        lines = asyncio.run(run(make_checkpoint(tmp / "ckpt"), tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "prefix_cache.json").open("w") as out:
        for line in lines:
            print(json.dumps(line), flush=True)
            out.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
