"""vLLM-pull rows of ``bench/transfer_bandwidth.py`` (``--protocol vllm``): what serving a vLLM
decode costs, on the same Llama-3-8B-shaped KV and the same memcpy reference.

Per pool layout and prompt length, a request's pages (scattered in the pool) go through the
vLLM sender chunk by chunk as the engine hands them over (``--chunk-tokens``, 2048 as the
push rows): each chunk's repack into the staging region in vLLM's layout runs on the repack
thread (``transfer/vllm/desk.py``); then a decode in a spawned process READs the staged
blocks over real NIXL as vLLM's connector does (one descriptor per block per layer) with its
completion notification. Each is timed against a memcpy of the same bytes in this process,
right after, so each sees the same machine load; medians over the repeats (the first is a
warm-up). One JSON line each::

    {"name": "transfer", "protocol": "vllm", "pool_layout", "tokens", "block_size",
     "chunk_tokens", "repack_ms", "repack_gb_s", "repack_tail_ms", "read_gb_s",
     "memcpy_gb_s", "repack_ratio", "read_ratio", "pull_gb_s", "pull_serial_gb_s",
     "push_gb_s", "pull_vs_push"}

``repack_ms`` is every chunk's repack (``repack_gb_s`` its rate); ``repack_tail_ms`` what of
it a user waits for: from the last chunk's hand-over to the request's success (its answer
may go), the earlier chunks' repacks having ended behind the next chunk's forward (here they
are waited for before the next hand-over, as a forward longer than a chunk's repack hides
them: seconds on this CPU worker, against ~0.1-0.2 s per 2048 tokens of repack).
``pull_gb_s``, the pull path as a user sees it: the KV's bytes over the time from the
prefill's last forward to the decode holding the KV, ``repack_tail_ms`` plus the READ (the
proxy's hop and the handshake are not counted). ``pull_serial_gb_s``: the same with every
repack counted (nothing to hide behind). ``push_gb_s`` is the same run's push of the same
scattered pages (``gb_s`` of its ``scattered`` row, from the first chunk's hand-over to the
decode's status), and ``pull_vs_push`` is ``pull_gb_s / push_gb_s``: goal (issue 30) >= 0.9.
Without ``--protocol push`` in the same run both are absent.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from prefill_worker.kv.layout import KVLayout, KVRegions

BLOCK_SIZE = 32
TOKENS = (1024, 8192)


class _Channel:
    """The side channel's place: the bench hands the registration to its decode itself."""

    def __init__(self, registration: Any) -> None:
        self.registration, self.port = registration, 0

    def poll(self) -> int:
        return 0

    def close(self) -> None:
        pass


def decode_main(conn: Connection, registration: Any, num_blocks: int) -> None:
    """READ the blocks it is sent, answer the seconds each READ took."""
    from prefill_worker.transfer.nixl.agent import make_agent

    agent = make_agent("bench-vllm-decode", ["UCX"], "lo")
    size = registration.block_bytes
    layers = len(registration.region_base_addrs)
    buffer = np.ones(layers * num_blocks * size, np.uint8)  # touched: no page faults
    table = np.array([[buffer.ctypes.data, buffer.nbytes, 0]], dtype=np.uint64)
    reg = agent.register_memory(table, "DRAM")
    peer = agent.add_remote_agent(registration.agent_metadata)
    conn.send("ready")
    while (cmd := conn.recv()) != "exit":
        blocks, notif = cmd
        n = len(blocks)
        remote = [
            (base + b * size, size, 0) for base in registration.region_base_addrs for b in blocks
        ]
        local = [(buffer.ctypes.data + i * size, size, 0) for i in range(layers * n)]
        start = time.perf_counter()
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, "DRAM"),
            peer,
            notif.encode(),
        )
        agent.transfer(handle)
        while agent.check_xfer_state(handle) != "DONE":
            pass
        conn.send(time.perf_counter() - start)
        agent.release_xfer_handle(handle)
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)


def run(
    lay: KVLayout, regions: KVRegions, repeats: int, chunk_pages: int, push_gb_s: dict[int, float]
) -> None:
    """Every vLLM row for one pool layout; ``push_gb_s``: the same run's scattered push rows'
    GB/s by prompt length (empty without them)."""
    from prefill_worker.transfer.options import NixlOptions, VllmOptions
    from prefill_worker.transfer.vllm.backend import VllmBackend
    from prefill_worker.transfer.vllm.tickets import Tickets

    num_blocks = max(TOKENS) // BLOCK_SIZE
    nixl = NixlOptions(None, ("UCX",), "lo")
    options = VllmOptions("127.0.0.1", 0, BLOCK_SIZE, num_blocks, nixl=nixl)
    backend = VllmBackend(regions, options, Tickets(4), lambda h, p, r: _Channel(r))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_main, args=(child_conn, backend.registration, num_blocks))
    child.start()
    try:
        assert conn.recv() == "ready"
        largest = max(TOKENS) * lay.num_layers * 2 * lay.page_bytes // lay.page_size
        copy = _CopyReference(largest)
        for tokens in TOKENS:
            case = _Case(lay, tokens, chunk_pages, push_gb_s.get(tokens))
            _row(backend, conn, case, repeats, copy)
    finally:
        conn.send("exit")
        child.join(60)
        backend.close()


@dataclass(frozen=True, slots=True)
class _Case:
    lay: KVLayout
    tokens: int
    chunk_pages: int
    push_gb_s: float | None


@dataclass(frozen=True, slots=True)
class _Staged:
    params: dict[str, Any]
    num_bytes: int
    repack_s: float  # every chunk's repack
    tail_s: float  # from the last chunk's hand-over to success


def _row(backend: Any, conn: Connection, case: _Case, repeats: int, copy: _CopyReference) -> None:
    lay, tokens = case.lay, case.tokens
    rng = np.random.default_rng(tokens)
    staged, read_s, memcpy_s = [], [], []
    for room in range(tokens, tokens + repeats + 1):
        pages = [int(p) for p in rng.choice(lay.num_pages, tokens // lay.page_size, False)]
        done = _stage(backend, room, tokens, pages, case.chunk_pages)
        staged.append(done)
        conn.send((done.params["remote_block_ids"][0], f"{done.params['remote_request_id']}:1"))
        read_s.append(conn.recv())
        while len(backend.desk.holds):  # the READ's notification frees the blocks
            backend.poll()
        memcpy_s.append(copy.seconds(done.num_bytes))
    nbytes = staged[-1].num_bytes
    repack_s = [s.repack_s for s in staged]
    tail_s = [s.tail_s for s in staged]
    pull_s = [t + r for t, r in zip(tail_s, read_s, strict=True)]
    serial_s = [p + r for p, r in zip(repack_s, read_s, strict=True)]
    repack, tail, read, memcpy, pull, serial = (
        statistics.median(s[1:]) for s in (repack_s, tail_s, read_s, memcpy_s, pull_s, serial_s)
    )
    row: dict[str, Any] = {
        "name": "transfer",
        "protocol": "vllm",
        "pool_layout": lay.kind,
        "tokens": tokens,
        "block_size": BLOCK_SIZE,
        "chunk_tokens": case.chunk_pages * lay.page_size,
        "repack_ms": round(repack * 1e3, 2),
        "repack_gb_s": round(nbytes / repack / 1e9, 3),
        "repack_tail_ms": round(tail * 1e3, 2),
        "read_gb_s": round(nbytes / read / 1e9, 3),
        "memcpy_gb_s": round(nbytes / memcpy / 1e9, 3),
        "repack_ratio": round(memcpy / repack, 3),
        "read_ratio": round(memcpy / read, 3),
        "pull_gb_s": round(nbytes / pull / 1e9, 3),
        "pull_serial_gb_s": round(nbytes / serial / 1e9, 3),
    }
    if case.push_gb_s is not None:
        row["push_gb_s"] = case.push_gb_s
        row["pull_vs_push"] = round(nbytes / pull / 1e9 / case.push_gb_s, 3)
    print(json.dumps(row), flush=True)


def _stage(backend: Any, room: int, tokens: int, pages: list[int], chunk_pages: int) -> _Staged:
    """A request through the vLLM sender as the engine drives it, chunk by chunk: each chunk's
    repack waited for before the next is handed over (a forward would run meanwhile)."""
    backend.desk.tickets.open(room)
    sender = backend.create_sender(room, f"bench-{room}", tokens)
    sender.poll()
    repack_s = 0.0
    firsts = range(0, len(pages), chunk_pages)
    for first in firsts[:-1]:
        start = time.perf_counter()
        sender.send_pages(pages[first : first + chunk_pages], first)
        while backend.desk.has_repacks():
            backend.wait(0.01)  # a forward would run here; a spin would hold the GIL
        repack_s += time.perf_counter() - start
    start = time.perf_counter()
    sender.send_pages(pages[firsts[-1] :], firsts[-1])
    sender.send_aux(0)
    while not sender.poll().is_terminal:
        backend.wait(0.01)  # as the engine does when a turn found nothing to do
    tail_s = time.perf_counter() - start
    sender.close()
    params = backend.desk.tickets.take(room)
    assert params is not None, sender.failure_reason()
    return _Staged(dict(params), sender.written_bytes(), repack_s + tail_s, tail_s)


class _CopyReference:
    """The memcpy reference: two buffers allocated and touched once for the run, as the push
    rows' are (it was a fresh pair per copy: page faults and fresh mappings in the time), so
    both kinds of row divide by the same kind of copy."""

    def __init__(self, nbytes: int) -> None:
        self._src, self._dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)

    def seconds(self, nbytes: int) -> float:
        start = time.perf_counter()
        np.copyto(self._dst[:nbytes], self._src[:nbytes])
        return time.perf_counter() - start
