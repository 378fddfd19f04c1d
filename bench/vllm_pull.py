"""vLLM-pull rows of ``bench/transfer_bandwidth.py`` (``--protocol vllm``): what serving a vLLM
decode costs, on the same Llama-3-8B-shaped KV and the same memcpy reference.

Per pool layout and prompt length, each repeat stages one request's pages (scattered in the
pool, handed over in chunks of ``--chunk-tokens``, 2048 as the push rows) twice, then a decode
in a spawned process READs the staged blocks over real NIXL as vLLM's connector does: one
descriptor per block per layer on each side, both lists prepared once (its handshake), each
READ made from them by index (``make_prepped_xfer``) and timed from posting to done.

- ``"staging": "repack"``: the request as if no forward had written its blocks (a prefix hit,
  chunks before the claim): each chunk's repack into the staging region in vLLM's layout runs
  on the repack thread (``transfer/vllm/desk.py``). Three READs of the same staged blocks:
  into decode blocks scattered as the push rows' decode pages (no two adjacent; the last,
  with the completion notification: ``read_*``), into consecutive decode blocks
  (``read_adjacent_*``: NIXL merges descriptors adjacent, in order, on both sides) and into
  the same blocks in reverse (``read_reversed_*``: nothing merges).
- ``"staging": "mirror"``: the same pages as a claimed request's are staged in production:
  each chunk's slots asked of the sender, then a real forward of the chunk by the runner
  (``bench/kv_mirror.py``'s narrow model with Llama-3-8B's KV shape, over this pool) that
  writes its K/V into the pool and, through the KV mirror's thread, into the staging blocks,
  its pages then handed over (no repack may be queued: asserted); two scattered READs into
  the same decode blocks as the repack row's: right after the answer (``read_*``; no
  notification, the blocks stay held), then again (``read_settled_*``, with the
  notification).

``*_descriptors`` is what NIXL posted (its telemetry). ``descriptor_memcpy_gb_s`` is the
scattered READ's descriptors as memmoves in this process (``descriptor_kib`` each): what the
memory system gives for pieces of that size at those places, the ceiling for any transport,
as the push rows' ``scattered_memcpy_gb_s``. Each is timed against a memcpy of the same bytes
in this process, right after, so each sees the same machine load; medians over the repeats
(the first is a warm-up). One JSON line each::

    {"name": "transfer", "protocol": "vllm", "staging": "repack", "pool_layout", "tokens",
     "block_size", "descriptor_kib", "chunk_tokens", "repack_ms", "repack_gb_s",
     "repack_tail_ms", "read_ms", "read_gb_s", "read_descriptors", "read_adjacent_gb_s",
     "read_adjacent_descriptors", "read_reversed_gb_s", "read_reversed_descriptors",
     "descriptor_memcpy_gb_s", "memcpy_gb_s", "repack_ratio", "read_ratio",
     "read_descriptor_ratio", "pull_gb_s", "pull_serial_gb_s", "push_gb_s", "pull_vs_push",
     "read_vs_push"}
    {"name": "transfer", "protocol": "vllm", "staging": "mirror", "pool_layout", "tokens",
     "chunk_tokens", "forward_ms", "mirror_copy_ms", "mirror_gb_s", "mirror_tail_ms",
     "answer_ms", "read_ms", "read_gb_s", "read_settled_ms", "read_settled_gb_s",
     "read_descriptors", "memcpy_gb_s", "pull_gb_s", "pull_settled_gb_s",
     "pull_vs_repack_pull", "push_gb_s", "pull_vs_push", "read_vs_push",
     "pull_settled_vs_push", "read_settled_vs_push", "paired_push", "paired_push_gb_s",
     "pull_vs_paired_push", "pull_settled_vs_paired_push"}

Repack rows: ``repack_ms`` is every chunk's repack (``repack_gb_s`` its rate);
``repack_tail_ms`` what of it a user waits for: from the last chunk's hand-over to the
request's success (its answer may go), the earlier chunks' repacks having ended behind the
next chunk's forward (here they are waited for before the next hand-over, as a forward longer
than a chunk's repack hides them: seconds on this CPU worker, against ~0.1-0.2 s per 2048
tokens of repack). ``pull_gb_s``, the pull path as a user sees it: the KV's bytes over the
time from the prefill's last forward to the decode holding the KV, ``repack_tail_ms`` plus
the scattered READ (the proxy's hop and the handshake are not counted). ``pull_serial_gb_s``:
the same with every repack counted (nothing to hide behind).

Mirror rows: ``forward_ms`` is the last chunk's forward, its mirror tail included;
``mirror_copy_ms`` the mirror's copies of every chunk on the mirror's thread (behind the
forward's layers; ``mirror_gb_s`` the KV's bytes over it), ``mirror_tail_ms`` what the last
chunk's forward waited for them after its last layer: the mirror's share of the pull path.
``answer_ms``: from the last chunk's hand-over to success (no repack to wait for).
``pull_gb_s``: the bytes over ``mirror_tail_ms + answer_ms`` plus the first READ,
``pull_settled_gb_s`` the same with the second; ``pull_vs_repack_pull`` the repack row's pull
time over this one's (> 1: the mirror is faster). The two READs differ only in when they run:
on the 2-core development VM the first, right after seconds of matmul, is often slower.
``paired_push_gb_s``: the push rows' native push (``transfer_bandwidth.push_once``: its own
decode process, scattered decode pages) of the same pages from the same pool, right after
each repeat's READs (``"paired_push": "after"``; ``--paired-push before``: right after the
answer, before the READs, where the first READ otherwise runs), so the push and the pull see
the same machine; ``pull_vs_paired_push`` and ``pull_settled_vs_paired_push`` the pull
paths against it.

``push_gb_s`` is the same run's push of the same scattered pages (``gb_s`` of its
``scattered`` row, from the first chunk's hand-over to the decode's status); ``pull_vs_push``
is ``pull_gb_s / push_gb_s`` (goal, issue 30: >= 0.9) and ``read_vs_push`` the READ alone
against the push: the transfer against the transfer (``*_settled_*``: with the second READ).
Without ``--protocol push`` in the same run they are absent. docs/vllm.md says which
comparison is like with like.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from kv_mirror import ForwardTimes, mirrored_forward

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.model.kv_cache import TORCH_DTYPES
from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.model.runner import Runner
from prefill_worker.request import SamplingParams

BLOCK_SIZE = 32
TOKENS = (1024, 8192)
MIRROR_ROOMS = 1 << 20  # the mirrored requests' rooms: never a repacked one's
GREEDY = SamplingParams(temperature=0.0)


class _Channel:
    """The side channel's place: the bench hands the registration to its decode itself."""

    def __init__(self, registration: Any) -> None:
        self.registration = registration
        self.ports = dict.fromkeys(registration.versions, 0)

    def poll(self) -> int:
        return 0

    def close(self) -> None:
        pass


def decode_main(conn: Connection, registration: Any, num_blocks: int) -> None:
    """READ the blocks it is sent into the decode blocks it is told, as vLLM's connector does:
    one descriptor per block per layer on each side, both lists prepared once at the handshake
    (``prep_xfer_dlist``) and each READ made from them by index (``make_prepped_xfer``); answer
    the seconds each READ took, from posting to done, and the descriptors NIXL posted for it
    (its telemetry: NIXL merges descriptors adjacent, in order, on both sides)."""
    os.environ["UCX_NET_DEVICES"] = "lo"  # this process only
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, capture_telemetry=True
    )
    agent = nixl_agent("bench-vllm-decode", config)
    size = registration.block_bytes
    bases = registration.region_base_addrs
    num_local = _decode_blocks(num_blocks)
    buffer = np.ones(len(bases) * num_local * size, np.uint8)  # touched: no page faults
    table = np.array([[buffer.ctypes.data, buffer.nbytes, 0]], dtype=np.uint64)
    reg = agent.register_memory(table, "DRAM")
    peer = agent.add_remote_agent(registration.agent_metadata)
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", _block_descs(buffer.ctypes.data, size, num_local, len(bases)), "DRAM"
    )
    remote_descs = [(base + b * size, size, 0) for base in bases for b in range(num_blocks)]
    remote = agent.prep_xfer_dlist(peer, remote_descs, "DRAM")
    conn.send("ready")
    while (cmd := conn.recv()) != "exit":
        remote_blocks, local_blocks, notif = cmd
        remote_ids = [i * num_blocks + b for i in range(len(bases)) for b in remote_blocks]
        local_ids = [i * num_local + b for i in range(len(bases)) for b in local_blocks]
        start = time.perf_counter()
        handle = agent.make_prepped_xfer(
            "READ", local, local_ids, remote, remote_ids, notif.encode()
        )
        agent.transfer(handle)
        while agent.check_xfer_state(handle) != "DONE":
            pass
        seconds = time.perf_counter() - start
        conn.send((seconds, agent.get_xfer_telemetry(handle).descCount))
        agent.release_xfer_handle(handle)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)


def _decode_blocks(num_blocks: int) -> int:
    """The decode's pool: a quarter larger than the staging region, as the push rows' decode."""
    return num_blocks + num_blocks // 4


def _block_descs(base: int, size: int, num_blocks: int, layers: int) -> list[tuple[int, int, int]]:
    """One (address, length, device) per block per layer: layer regions back to back."""
    return [
        (base + (i * num_blocks + b) * size, size, 0)
        for i in range(layers)
        for b in range(num_blocks)
    ]


def run(
    runner: Runner,
    repeats: int,
    chunk_pages: int,
    push_gb_s: dict[int, float],
    paired_push: str = "after",
) -> None:
    """Every vLLM row for one pool layout (``runner``: a model whose pool is the one staged
    from); ``push_gb_s``: the same run's scattered push rows' GB/s by prompt length (empty
    without them); ``paired_push``: the paired push ``after`` each mirrored request's READs, or
    ``before`` them (right after the answer, where the first READ otherwise runs)."""
    from prefill_worker.transfer.options import NixlOptions, VllmOptions
    from prefill_worker.transfer.vllm.backend import VllmBackend
    from prefill_worker.transfer.vllm.tickets import Tickets

    kv = runner.kv_cache
    lay, aux = kv.layout, AuxPool(16)
    num_blocks = max(TOKENS) // BLOCK_SIZE
    nixl = NixlOptions(None, ("UCX",), "lo")
    options = VllmOptions("127.0.0.1", 0, BLOCK_SIZE, num_blocks, nixl=nixl)
    regions = kv.regions(aux.base_addr, aux.num_rows)
    backend = VllmBackend(regions, options, Tickets(4), lambda h, p, r: _Channel(r))
    kv.attach_mirror(KVMirror(backend.mirror_layers, TORCH_DTYPES[lay.dtype]))
    assert aux.try_alloc() == 0
    aux.write(0, AuxRow(1, 0.0, 8192, 0))  # what the paired push sends as its aux row
    pusher = _Pusher(regions, paired_push)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_main, args=(child_conn, backend.registration, num_blocks))
    child.start()
    try:
        assert conn.recv() == "ready"
        largest = max(TOKENS) * lay.num_layers * 2 * lay.page_bytes // lay.page_size
        reg = backend.registration
        decode_bytes = len(reg.region_base_addrs) * _decode_blocks(num_blocks) * reg.block_bytes
        copy = _CopyReference(largest, decode_bytes)
        for tokens in TOKENS:
            vocab_size = runner.model.spec.vocab_size
            ids = np.random.default_rng(tokens).integers(0, vocab_size, tokens).tolist()
            case = _Case(runner, ids, chunk_pages, push_gb_s.get(tokens))
            _row(backend, conn, case, repeats, copy, pusher)
    finally:
        conn.send("exit")
        child.join(60)
        backend.close()
        pusher.close()


class _Pusher:
    """The push rows' native push (``transfer_bandwidth.push_once``, its decode process and
    scattered decode pages) of the same pages from the same pool, right after each mirrored
    request's READs: the push paired with the pull, each seeing the same machine."""

    def __init__(self, regions: Any, when: str) -> None:
        import transfer_bandwidth

        from prefill_worker.transfer import make_backend
        from prefill_worker.transfer.options import NativeOptions

        assert when in ("after", "before"), when
        self._bench, self.when = transfer_bandwidth, when
        options = NativeOptions("tcp://127.0.0.1:0", 30.0, 0.2, push_thread=True)
        self.backend = make_backend(regions, options)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (child, self.backend.bootstrap_endpoint, regions.layout.kind)
        self._proc = ctx.Process(target=transfer_bandwidth.decode_main, args=args, daemon=True)
        self._proc.start()
        while not self._conn.poll(0.001):
            self.backend.poll()
        assert self._conn.recv() == "registered"
        self._room, self._rng = 1 << 22, np.random.default_rng(7)

    def seconds(self, pages: list[int], chunk_pages: int) -> float:
        """One push of ``pages`` (from the first chunk's hand-over to the decode's status)."""
        bench, self._room = self._bench, self._room + 1
        dst = bench.scattered(self._rng, bench.NUM_DECODE_PAGES, len(pages))
        elapsed, _, _ = bench.push_once(
            self.backend, self._conn, self._room, pages, dst, chunk_pages
        )
        return float(elapsed)

    def close(self) -> None:
        self._conn.send(("exit",))
        self._proc.join(10)
        self.backend.close()


@dataclass(frozen=True, slots=True)
class _Case:
    runner: Runner  # its pool is the one staged from, with the mirror attached
    token_ids: list[int]  # the prompt the mirrored request's forwards compute
    chunk_pages: int
    push_gb_s: float | None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class _Staged:
    params: dict[str, Any]
    num_bytes: int
    repack_s: float  # every chunk's repack
    tail_s: float  # from the last chunk's hand-over to success


def _row(
    backend: Any,
    conn: Connection,
    case: _Case,
    repeats: int,
    copy: _CopyReference,
    pusher: _Pusher,
) -> None:
    """The request staged by the repack, then by the mirror, the same pages each time, each
    READ into the same scattered decode blocks; a repack row and a mirror row."""
    lay, tokens, reg = case.runner.kv_cache.layout, case.tokens, backend.registration
    rng = np.random.default_rng(tokens)
    num_local = _decode_blocks(reg.num_blocks)
    staged: list[_Staged] = []
    mirrored: list[_MirrorStaged] = []
    # scattered, adjacent, reversed; the mirrored request's first and settled
    reads: tuple[list[tuple[float, int]], ...] = ([], [], [], [], [])
    floor_s: list[float] = []
    memcpy_s: list[float] = []
    push_s: list[float] = []  # the paired push of each repeat's pages
    for room in range(tokens, tokens + repeats + 1):
        pages = [int(p) for p in rng.choice(lay.num_pages, tokens // lay.page_size, False)]
        done = _stage(backend, room, tokens, pages, case.chunk_pages)
        staged.append(done)
        blocks = done.params["remote_block_ids"][0]
        in_order = list(range(len(blocks)))  # consecutive decode blocks: NIXL may merge
        reads[1].append(_read(conn, blocks, in_order, ""))  # no notification: still held
        reads[2].append(_read(conn, blocks, in_order[::-1], ""))  # in reverse: no merge
        local = _scattered(rng, num_local, len(blocks))
        reads[0].append(_read(conn, blocks, local, f"{done.params['remote_request_id']}:1"))
        floor_s.append(copy.descriptor_seconds(reg, blocks, local))
        _until_released(backend)
        memcpy_s.append(copy.seconds(done.num_bytes))
        by_mirror = _stage_mirrored(backend, case, MIRROR_ROOMS + room, pages)
        mirrored.append(by_mirror)
        mirror_blocks = by_mirror.params["remote_block_ids"][0]
        notif = f"{by_mirror.params['remote_request_id']}:1"
        if pusher.when == "before":
            push_s.append(pusher.seconds(pages, case.chunk_pages))
        reads[3].append(_read(conn, mirror_blocks, local, ""))  # right after the forward
        reads[4].append(_read(conn, mirror_blocks, local, notif))
        _until_released(backend)
        if pusher.when == "after":
            push_s.append(pusher.seconds(pages, case.chunk_pages))
    nbytes = staged[-1].num_bytes
    descs = [r[-1][1] for r in reads[:3]]
    read_s, adjacent_s, reversed_s = ([seconds for seconds, _ in r] for r in reads[:3])
    repack_s = [s.repack_s for s in staged]
    tail_s = [s.tail_s for s in staged]
    pull_s = [t + r for t, r in zip(tail_s, read_s, strict=True)]
    serial_s = [p + r for p, r in zip(repack_s, read_s, strict=True)]
    series = (repack_s, tail_s, read_s, adjacent_s, reversed_s, floor_s, memcpy_s, pull_s, serial_s)
    repack, tail, read, adjacent, backwards, floor, memcpy, pull, serial = (
        statistics.median(s[1:]) for s in series
    )
    row: dict[str, Any] = {
        "name": "transfer",
        "protocol": "vllm",
        "staging": "repack",
        "pool_layout": lay.kind,
        "tokens": tokens,
        "block_size": reg.block_size,
        "descriptor_kib": reg.block_bytes // 1024,
        "chunk_tokens": case.chunk_pages * lay.page_size,
        "repack_ms": round(repack * 1e3, 2),
        "repack_gb_s": round(nbytes / repack / 1e9, 3),
        "repack_tail_ms": round(tail * 1e3, 2),
        "read_ms": round(read * 1e3, 2),
        "read_gb_s": round(nbytes / read / 1e9, 3),
        "read_descriptors": descs[0],
        "read_adjacent_gb_s": round(nbytes / adjacent / 1e9, 3),
        "read_adjacent_descriptors": descs[1],
        "read_reversed_gb_s": round(nbytes / backwards / 1e9, 3),
        "read_reversed_descriptors": descs[2],
        "descriptor_memcpy_gb_s": round(nbytes / floor / 1e9, 3),
        "memcpy_gb_s": round(nbytes / memcpy / 1e9, 3),
        "repack_ratio": round(memcpy / repack, 3),
        "read_ratio": round(memcpy / read, 3),
        "read_descriptor_ratio": round(floor / read, 3),
        "pull_gb_s": round(nbytes / pull / 1e9, 3),
        "pull_serial_gb_s": round(nbytes / serial / 1e9, 3),
    }
    _compare(row, case.push_gb_s, nbytes / pull / 1e9, nbytes / read / 1e9)
    print(json.dumps(row), flush=True)
    mirror_reads = (reads[3], reads[4])
    mirror_row = _mirror_row(case, mirrored, mirror_reads, memcpy_s, pull)
    paired_push = nbytes / statistics.median(push_s[1:]) / 1e9
    mirror_row["paired_push"] = pusher.when
    mirror_row["paired_push_gb_s"] = round(paired_push, 3)
    mirror_row["pull_vs_paired_push"] = round(mirror_row["pull_gb_s"] / paired_push, 3)
    mirror_row["pull_settled_vs_paired_push"] = round(
        mirror_row["pull_settled_gb_s"] / paired_push, 3
    )
    print(json.dumps(mirror_row), flush=True)


def _mirror_row(
    case: _Case,
    mirrored: list[_MirrorStaged],
    reads: tuple[list[tuple[float, int]], list[tuple[float, int]]],
    memcpy_s: list[float],
    repack_pull_s: float,
) -> dict[str, Any]:
    """The mirrored request's row: the last forward, the mirror's copies and tail, the answer,
    the READs, and the pull path a user waits for (the tail, the answer, the READ)."""
    nbytes = mirrored[-1].num_bytes
    assert all(m.num_repacks == 0 for m in mirrored), "a mirrored request was repacked"
    first, settled = ([seconds for seconds, _ in r] for r in reads)
    tail_s = [m.forwards[-1].wait_s + m.answer_s for m in mirrored]
    series = (
        [m.forwards[-1].forward_s for m in mirrored],
        [sum(f.copy_s for f in m.forwards) for m in mirrored],
        [m.forwards[-1].wait_s for m in mirrored],
        [m.answer_s for m in mirrored],
        first,
        settled,
        [t + r for t, r in zip(tail_s, first, strict=True)],
        [t + r for t, r in zip(tail_s, settled, strict=True)],
        memcpy_s,
    )
    forward, copy, tail, answer, read, read_settled, pull, pull_settled, memcpy = (
        statistics.median(s[1:]) for s in series
    )
    lay = case.runner.kv_cache.layout
    row: dict[str, Any] = {
        "name": "transfer",
        "protocol": "vllm",
        "staging": "mirror",
        "pool_layout": lay.kind,
        "tokens": case.tokens,
        "chunk_tokens": case.chunk_pages * lay.page_size,
        "forward_ms": round(forward * 1e3, 1),
        "mirror_copy_ms": round(copy * 1e3, 2),
        "mirror_gb_s": round(nbytes / copy / 1e9, 3),
        "mirror_tail_ms": round(tail * 1e3, 3),
        "answer_ms": round(answer * 1e3, 3),
        "read_ms": round(read * 1e3, 2),
        "read_gb_s": round(nbytes / read / 1e9, 3),
        "read_settled_ms": round(read_settled * 1e3, 2),
        "read_settled_gb_s": round(nbytes / read_settled / 1e9, 3),
        "read_descriptors": reads[1][-1][1],
        "memcpy_gb_s": round(nbytes / memcpy / 1e9, 3),
        "pull_gb_s": round(nbytes / pull / 1e9, 3),
        "pull_settled_gb_s": round(nbytes / pull_settled / 1e9, 3),
        "pull_vs_repack_pull": round(repack_pull_s / pull, 3),
    }
    _compare(row, case.push_gb_s, nbytes / pull / 1e9, nbytes / read / 1e9)
    if case.push_gb_s is not None:
        row["pull_settled_vs_push"] = round(nbytes / pull_settled / 1e9 / case.push_gb_s, 3)
        row["read_settled_vs_push"] = round(nbytes / read_settled / 1e9 / case.push_gb_s, 3)
    return row


def _compare(row: dict[str, Any], push_gb_s: float | None, pull: float, read: float) -> None:
    """The pull path and the READ against the same run's push (absent without one)."""
    if push_gb_s is not None:
        row["push_gb_s"] = push_gb_s
        row["pull_vs_push"] = round(pull / push_gb_s, 3)
        row["read_vs_push"] = round(read / push_gb_s, 3)


def _until_released(backend: Any) -> None:
    """Until the READ's notification frees the blocks (the decode sent it: a few turns)."""
    while len(backend.desk.holds):
        backend.poll()


def _read(conn: Connection, blocks: list[int], local: list[int], notif: str) -> tuple[float, int]:
    """One READ by the decode: its seconds and the descriptors NIXL posted."""
    conn.send((blocks, local, notif))
    seconds, num_descriptors = conn.recv()
    return seconds, num_descriptors


def _scattered(rng: np.random.Generator, num_total: int, n: int) -> list[int]:
    """n distinct blocks of ``num_total``, no two consecutive entries adjacent (the push rows'
    scattered decode pages, in blocks)."""
    while True:
        blocks = rng.choice(num_total, n, replace=False)
        if not np.any(np.abs(np.diff(blocks)) == 1):
            return [int(b) for b in blocks]


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
    params = _answer(backend, sender, room)
    tail_s = time.perf_counter() - start
    return _Staged(params, sender.written_bytes(), repack_s + tail_s, tail_s)


def _answer(backend: Any, sender: Any, room: int) -> dict[str, Any]:
    """After the last chunk: the aux row, the wait for success (the answer may go), the
    sender closed; the answer's params."""
    sender.send_aux(0)
    while not sender.poll().is_terminal:
        backend.wait(0.01)  # as the engine does when a turn found nothing to do
    sender.close()
    params = backend.desk.tickets.take(room)
    assert params is not None, sender.failure_reason()
    return dict(params)


@dataclass(frozen=True, slots=True)
class _MirrorStaged:
    """A request staged by the mirror (``_stage_mirrored``)."""

    params: dict[str, Any]
    num_bytes: int
    forwards: list[ForwardTimes]  # one per chunk, in order
    answer_s: float  # from the last chunk's hand-over to success (the answer may go)
    num_repacks: int  # repacks the desk began for it (0: every token mirrored)


def _stage_mirrored(backend: Any, case: _Case, room: int, pages: list[int]) -> _MirrorStaged:
    """A request through the vLLM sender as the engine drives a mirrored one: each chunk's
    slots asked as it is planned, the chunk's forward run by the runner (its K/V into the
    pool, and by the mirror's thread into the staging blocks), its pages then handed over."""
    runner, chunk_pages = case.runner, case.chunk_pages
    ps, tokens = runner.kv_cache.layout.page_size, case.tokens
    backend.desk.tickets.open(room)
    sender = backend.create_sender(room, f"bench-mirror-{room}", tokens)
    sender.poll()
    repacks, forwards = backend.desk.counts.repacks, []
    start_s = 0.0
    for first in range(0, len(pages), chunk_pages):
        start, end = first * ps, min((first + chunk_pages) * ps, tokens)
        sampling = GREEDY if end == tokens else None
        chunk = ChunkPlan(
            f"bench-mirror-{room}",
            case.token_ids[start:end],
            start,
            end,
            pages[: -(-end // ps)],
            sampling,
            mirror_slots=sender.mirror_slots(start, end),
        )
        forwards.append(mirrored_forward(runner, BatchPlan(room, (chunk,))))
        start_s = time.perf_counter()
        sender.send_pages(pages[first : first + chunk_pages], first)
    params = _answer(backend, sender, room)
    answer_s = time.perf_counter() - start_s
    num_repacks = backend.desk.counts.repacks - repacks
    return _MirrorStaged(params, sender.written_bytes(), forwards, answer_s, num_repacks)


class _CopyReference:
    """The memcpy reference: two buffers allocated and touched once for the run, as the push
    rows' are (it was a fresh pair per copy: page faults and fresh mappings in the time), so
    both kinds of row divide by the same kind of copy."""

    def __init__(self, nbytes: int, decode_bytes: int) -> None:
        self._src, self._dst = np.ones(nbytes, np.uint8), np.ones(decode_bytes, np.uint8)

    def seconds(self, nbytes: int) -> float:
        start = time.perf_counter()
        np.copyto(self._dst[:nbytes], self._src[:nbytes])
        return time.perf_counter() - start

    def descriptor_seconds(self, reg: Any, blocks: list[int], local: list[int]) -> float:
        """The READ's descriptors as memmoves in this process: each staged block of each layer
        to its decode block (in ``_dst`` laid out as the decode's pool, layer regions of
        ``_decode_blocks`` blocks): what the memory system gives for pieces of that size."""
        size, num_local = reg.block_bytes, _decode_blocks(reg.num_blocks)
        dst = self._dst.ctypes.data
        pairs = [
            (dst + (i * num_local + d) * size, base + b * size)
            for i, base in enumerate(reg.region_base_addrs)
            for b, d in zip(blocks, local, strict=True)
        ]
        memmove = ctypes.memmove
        start = time.perf_counter()
        for to, frm in pairs:
            memmove(to, frm, size)
        return time.perf_counter() - start
