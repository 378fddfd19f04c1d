"""The engine-loop stall a KV push causes: how long, in one engine turn, the engine thread is
inside the transfer backend (issue 17; ``bench/e2e.py`` reports it beside its load points).

A real engine (overlapped forwards on CPU, sdpa) over a random model shaped to make KV heavy
and forwards light (32 layers, hidden 256, 4 heads and 4 KV heads of 64, fp32: 64 KiB of KV
per token, 128 MiB per 2048-token chunk) pushes every prompt over real NIXL to a decode
process. The backend is wrapped (``TimedBackend``, the ``TransferBackend`` seam): every call
the engine thread makes into it or its senders is timed, except ``wait`` (the engine sleeping
when it has nothing to do). A turn starts at the engine's ``poll``; ``stall`` is the time a
turn spent in transfer calls, which is what delays the next forward's launch. Per pool layout
and per push (``thread``: the transfer thread; ``inline``: posted on the engine thread, as
before #17), one JSON line::

    {"name": "engine_stall", "pool_layout", "push", "num_requests", "num_turns",
     "stall_max_ms", "stall_p99_ms", "stall_p50_ms", "stall_cpu_max_ms", "kv_mib_per_request"}

Goal: ``stall_max_ms`` < 5 with the transfer thread. ``stall_cpu_max_ms`` is the same turn
measured in the engine thread's CPU time: the work the transfer calls do, without the time
the thread waited for a core (where the copy, the forward and the engine share too few
cores, the wall time of a turn is mostly that wait).

    python bench/engine_stall.py [--requests 6] [--push thread,inline]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefill_worker.inbox import Inbox  # noqa: E402
from prefill_worker.kv.aux import AuxPool  # noqa: E402
from prefill_worker.kv.layout import POOL_LAYOUTS, KVLayout  # noqa: E402
from prefill_worker.kv.pages import PagePool  # noqa: E402
from prefill_worker.request import Outcome, OutcomeStatus, PrefillRequest, SamplingParams  # noqa: E402
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits  # noqa: E402
from prefill_worker.testing.random_model import random_runner  # noqa: E402

SHAPE = dict(
    architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=256, intermediate_size=512,
    num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
    max_position_embeddings=4096,
)  # fmt: skip
PAGE_SIZE, PROMPT, CHUNK = 16, 2048, 2048
NUM_PAGES = 4 * PROMPT // PAGE_SIZE


class TimedBackend:
    """A ``TransferBackend`` that times the engine thread's calls into ``inner``, per turn."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.bootstrap_endpoint = inner.bootstrap_endpoint
        self.turns: list[float] = []  # seconds in transfer calls, one entry per engine turn
        self.cpu_turns: list[float] = []  # the same in the engine thread's CPU time
        self.first_push_turn = 0  # turns before it: idle, and the decode's registration
        self._turn = self._cpu_turn = 0.0

    def mark_pushes(self) -> None:
        """From the next turn on, turns are the pushes' (any thread may call it)."""
        self.first_push_turn = len(self.turns) + 1

    def timed(self, fn: Any, *args: Any) -> Any:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self._turn += time.perf_counter() - start
            self._cpu_turn += time.thread_time() - start_cpu

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> TimedSender:
        inner = self.timed(
            self._inner.create_sender,
            room,
            request_id,
            num_prompt_tokens,
            allowed_peer,
            traceparent,
        )
        return TimedSender(self, inner)

    def poll(self) -> None:
        self.turns.append(self._turn)  # the engine polls first thing in a turn
        self.cpu_turns.append(self._cpu_turn)
        self._turn = self._cpu_turn = 0.0
        self.timed(self._inner.poll)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        self._inner.wait(timeout_s, wake_fd)  # sleeping, not stalling

    def close(self) -> None:
        self._inner.close()


class TimedSender:
    """A ``KVSender`` whose every call is timed into its backend's turn."""

    def __init__(self, backend: TimedBackend, inner: Any) -> None:
        self._b, self._s = backend, inner

    def poll(self) -> Any:
        return self._b.timed(self._s.poll)

    def num_cached_tokens(self) -> int:
        return int(self._b.timed(self._s.num_cached_tokens))

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        self._b.timed(self._s.send_pages, page_ids, first_page)

    def send_aux(self, aux_row: int) -> None:
        self._b.timed(self._s.send_aux, aux_row)

    def fail(self, reason: str) -> None:
        self._b.timed(self._s.fail, reason)

    def failure_reason(self) -> str | None:
        return self._s.failure_reason()  # type: ignore[no-any-return]

    def written_bytes(self) -> int:
        return int(self._s.written_bytes())

    def close(self) -> None:
        self._b.timed(self._s.close)


def decode_main(conn: Connection, addr: str, layout: KVLayout, num_pages: int) -> None:
    """A decode process: a pool of the layout, wants on command, waits with its I/O thread."""
    from prefill_worker.transfer import KVReceiver, RoomState

    runner, _ = random_runner(
        SHAPE, torch.float32, torch.device("cpu"), "sdpa", PAGE_SIZE, num_pages, 0, layout.kind
    )
    cache = runner.kv_cache
    receiver = KVReceiver.from_tensors(
        cache.k, cache.v, addr, num_aux_rows=16, pool_layout=layout.kind, io_thread=True
    )
    receiver.wait_registered(60)
    conn.send("registered")
    while (cmd := conn.recv())[0] != "exit":
        _, room, pages, slot = cmd
        receiver.want(room, pages, slot, 0)
        conn.send("wanted")
    statuses = [receiver.wait(room, 300) for room in cmd[1]]
    conn.send([s for s in statuses if s.state is not RoomState.DONE])
    receiver.close()


def run(pool_layout: str, push: str, num_requests: int) -> dict[str, object]:
    from prefill_worker.transfer import make_backend
    from prefill_worker.transfer.options import NativeOptions

    runner, _ = random_runner(
        SHAPE, torch.float32, torch.device("cpu"), "sdpa", PAGE_SIZE, NUM_PAGES, 0, pool_layout
    )
    pages, aux = PagePool(NUM_PAGES), AuxPool(16)
    regions = runner.kv_cache.regions(aux.base_addr, aux.num_rows)
    options = NativeOptions("tcp://127.0.0.1:0", 30.0, 0.5, push_thread=push == "thread")
    inner = make_backend(regions, options)
    backend = TimedBackend(inner)
    outcomes: list[Outcome] = []
    engine = Engine(
        runner,
        backend,
        EngineKV(pages, aux),
        outcomes.append,
        EngineLimits(
            page_size=PAGE_SIZE,
            chunk_size=CHUNK,
            max_batch_tokens=CHUNK,
            max_running_requests=8,
            bootstrap_timeout_s=120.0,
            transfer_timeout_s=120.0,
        ),
        overlap=True,
    )
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    per_request, total = PROMPT // PAGE_SIZE, num_requests + 1  # the first is a warm-up
    args = (child, backend.bootstrap_endpoint, runner.kv_cache.layout, total * per_request)
    proc = ctx.Process(target=decode_main, args=args, daemon=True)
    proc.start()
    inbox, stop = Inbox(), threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop, inbox), daemon=True)
    thread.start()
    try:
        assert conn.poll(120) and conn.recv() == "registered"
        for i in range(total):
            dst = list(range(i * per_request, (i + 1) * per_request))
            conn.send(("want", 1000 + i, dst, i % 16))
            assert conn.recv() == "wanted"
            ids = [(7 * i + 3 * t) % SHAPE["vocab_size"] for t in range(PROMPT)]
            arrival = time.monotonic()  # the engine's deadlines count from it
            inbox.put(PrefillRequest(f"r{i}", ids, SamplingParams(), False, 1000 + i, arrival))
            deadline = time.monotonic() + 600
            while not outcomes and time.monotonic() < deadline:
                time.sleep(0.05)  # the bench's own pacing, not synchronisation under test
            if i == 0:
                backend.mark_pushes()  # the warm-up request has ended: measure from here
        while len(outcomes) < total and time.monotonic() < deadline:
            time.sleep(0.05)
        conn.send(("exit", [1000 + i for i in range(total)]))
        assert conn.poll(330), "the decode never answered"
        not_done = conn.recv()
        assert not not_done, not_done
    finally:
        stop.set()
        inbox.wake()
        thread.join(60)
        engine.shutdown()
        proc.join(30)
        backend.close()
    assert [o.status for o in outcomes] == [OutcomeStatus.OK] * total, outcomes
    turns = sorted(backend.turns[backend.first_push_turn :])
    before = backend.turns[1 : backend.first_push_turn] or [0.0]
    layout = runner.kv_cache.layout
    request_bytes = PROMPT * layout.pool_bytes // (layout.num_pages * PAGE_SIZE)
    return {
        "name": "engine_stall",
        "pool_layout": pool_layout,
        "push": push,
        "num_requests": num_requests,
        "num_turns": len(turns),
        "stall_max_ms": round(turns[-1] * 1e3, 3),
        "stall_p99_ms": round(turns[int(0.99 * (len(turns) - 1))] * 1e3, 3),
        "stall_p50_ms": round(statistics.median(turns) * 1e3, 3),
        "stall_cpu_max_ms": round(max(backend.cpu_turns[backend.first_push_turn :]) * 1e3, 3),
        "warmup_stall_ms": round(max(before) * 1e3, 3),
        "kv_mib_per_request": round(request_bytes / 2**20, 1),
    }


def lines(num_requests: int, pushes: Sequence[str] = ("thread",)) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    return [run(layout, push, num_requests) for push in pushes for layout in POOL_LAYOUTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--push", default="thread,inline")
    args = parser.parse_args()
    for line in lines(args.requests, args.push.split(",")):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
