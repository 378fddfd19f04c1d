"""vLLM-pull rows of ``bench/transfer_bandwidth.py`` (``--protocol vllm``): what serving a vLLM
decode costs, on the same Llama-3-8B-shaped KV and the same memcpy reference.

Per pool layout and prompt length: the repack of a request's pages (scattered in the pool)
into the staging region in vLLM's layout (``transfer/vllm/staging.py``, on the engine thread),
then a decode in a spawned process READs the staged blocks over real NIXL as vLLM's
connector does (one descriptor per block per layer) with its completion notification. Both
are timed against a memcpy of the same bytes in this process, right after, so each sees the
same machine load; medians over the repeats (the first is a warm-up). One JSON line each::

    {"name": "transfer", "protocol": "vllm", "pool_layout", "tokens", "block_size",
     "repack_ms", "repack_gb_s", "read_gb_s", "memcpy_gb_s", "repack_ratio", "read_ratio"}

Goal (issue 30): ``read_ratio`` within 10% of the push rows' ``ratio`` of the same run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
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


def run(lay: KVLayout, regions: KVRegions, repeats: int) -> None:
    """Every vLLM row for one pool layout."""
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
            _row(backend, conn, lay, tokens, repeats, copy)
    finally:
        conn.send("exit")
        child.join(60)
        backend.close()


def _row(
    backend: Any, conn: Connection, lay: KVLayout, tokens: int, repeats: int, copy: _CopyReference
) -> None:
    rng = np.random.default_rng(tokens)
    repack_s, read_s, memcpy_s = [], [], []
    nbytes = 0
    for room in range(tokens, tokens + repeats + 1):
        pages = [int(p) for p in rng.choice(lay.num_pages, tokens // lay.page_size, False)]
        start = time.perf_counter()
        params, nbytes = _stage(backend, room, tokens, pages)
        repack_s.append(time.perf_counter() - start)
        conn.send((params["remote_block_ids"][0], f"{params['remote_request_id']}:1"))
        read_s.append(conn.recv())
        while len(backend.desk.holds):  # the READ's notification frees the blocks
            backend.poll()
        memcpy_s.append(copy.seconds(nbytes))
    repack, read, memcpy = (statistics.median(s[1:]) for s in (repack_s, read_s, memcpy_s))
    row = {
        "name": "transfer",
        "protocol": "vllm",
        "pool_layout": lay.kind,
        "tokens": tokens,
        "block_size": BLOCK_SIZE,
        "repack_ms": round(repack * 1e3, 2),
        "repack_gb_s": round(nbytes / repack / 1e9, 3),
        "read_gb_s": round(nbytes / read / 1e9, 3),
        "memcpy_gb_s": round(nbytes / memcpy / 1e9, 3),
        "repack_ratio": round(memcpy / repack, 3),
        "read_ratio": round(memcpy / read, 3),
    }
    print(json.dumps(row), flush=True)


def _stage(backend: Any, room: int, tokens: int, pages: list[int]) -> tuple[dict[str, Any], int]:
    """A request through the vLLM sender as the engine drives it: its params and bytes."""
    backend.desk.tickets.open(room)
    sender = backend.create_sender(room, f"bench-{room}", tokens)
    sender.poll()
    sender.send_pages(pages, 0)
    sender.send_aux(0)
    sender.close()
    params = backend.desk.tickets.take(room)
    assert params is not None, sender.failure_reason()
    return dict(params), sender.written_bytes()


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
