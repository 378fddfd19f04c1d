"""The vLLM-push rows of ``bench/transfer_bandwidth.py`` (``--protocol push,vllm-push``): the
worker's ``VllmBackend`` serving push (``transfer.vllm_transfer_modes: [push]``) over the
same Llama-3-8B-shaped pool, and a decode process that does what vLLM's push decode does on
the wire, without vLLM: its blocks registered in LBHNC (one region per layer, block size 32,
scattered: no two of a request's blocks adjacent), its own side channel serving its metadata
with the worker's push-mode hash, a handshake with the worker's push side channel, then per
request the ``PUSH_REG`` notification and a wait for ``"<id>:1"``. One JSON line per prompt
length::

    {"name": "transfer", "protocol": "vllm-push", "pool_layout", "tokens", "gb_s",
     "memcpy_gb_s", "ratio", "native_push_gb_s", "vllm_push_vs_native", "write_ms",
     "registered_to_notified_ms", "descriptors", "load_avg"}

``write_ms``: the WRITE alone, posted to settled on the worker's push thread;
``registered_to_notified_ms``: what ``gb_s`` is computed from.

``gb_s``: the prompt's KV (every layer's K and V, the native rows' bytes) over the time from
the decode sending its registration to the decode holding the worker's notification (the
rig turns the backend as the engine does: ``poll``, then ``wait``, which sleeps until
``PUSH_POLL_S`` while the registration is awaited and on the transfer thread's wake fd while
the WRITE runs, as the native rows' loop sleeps in ``wait`` during their push):
what a push decode waits for once it registered. The request's staged blocks are held as a
finished request's are (``desk.hold``); no forward runs here (the staging is what the KV
mirror fills during the forwards, off this path). ``native_push_gb_s`` is the same run's
native thread push of the same bytes to scattered decode pages (its first chunk's hand-over
to its status).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

BLOCK_SIZE = 32
TOKENS = (1024, 8192)
VERSION = "0.34.0"
NOTIF_POLL_S = 0.0005  # how often the decode looks for the worker's notification


def decode_main(conn: Connection, registration: Any, push_hash: str, port: int) -> None:
    """vLLM's push decode on the wire, without vLLM (module docstring)."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    from prefill_worker.transfer.nixl.agent import make_agent
    from prefill_worker.transfer.vllm.handshake import (
        HandshakePayload,
        SideChannel,
        encode_payload,
    )
    from prefill_worker.transfer.vllm.link import fetch_payload
    from prefill_worker.transfer.vllm.profiles import PROFILES, LayerRegion, agent_metadata
    from prefill_worker.transfer.vllm.push import PUSH_REG_PREFIX

    lay = registration.layout
    num_blocks = max(TOKENS) // BLOCK_SIZE * 5 // 4  # as the native rows' decode pool
    blocks = np.ones(lay.num_layers * num_blocks * lay.block_bytes, np.uint8)  # touched
    agent = make_agent("bench-vllm-push-decode", ["UCX"], "lo")  # as the pull bench decode
    region = num_blocks * lay.block_bytes
    bases = [int(blocks.ctypes.data) + i * region for i in range(lay.num_layers)]
    table = np.array([[b, region, 0] for b in bases], np.uint64)
    reg = agent.register_memory(table, "DRAM")
    layers = [
        LayerRegion(f"model.layers.{i}.self_attn.attn", b, lay.block_bytes)
        for i, b in enumerate(bases)
    ]
    meta = agent_metadata(
        PROFILES[VERSION],
        "bench-decode",
        agent.get_agent_metadata(),
        layers,
        num_blocks,
        lay.block_size,
        registration.identity.attention_backend,
    )
    channel = SideChannel("127.0.0.1", 0, {(0, 0): encode_payload(push_hash, meta)})
    answer = msgspec.msgpack.decode(fetch_payload("127.0.0.1", port), type=HandshakePayload)
    assert answer.compatibility_hash == push_hash
    ours = msgspec.msgpack.decode(answer.agent_metadata_bytes)
    prefill = agent.add_remote_agent(ours["agent_metadata"])
    conn.send(("ready", num_blocks))
    while True:
        channel.poll()  # the worker handshakes before its first WRITE
        if not conn.poll(0.0005):
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        request_id, local = args
        body = {
            "request_id": request_id,
            "decode_engine_id": "bench-decode",
            "decode_host": "127.0.0.1",
            "decode_port": channel.port,
            "decode_tp_size": 1,
            "local_block_ids": [local],
        }
        want = f"{request_id}:1".encode()
        start = time.perf_counter()
        agent.send_notif(prefill, PUSH_REG_PREFIX + msgspec.msgpack.encode(body))
        done = False
        while not done:  # every 0.5 ms, as the native rows' decode polls between commands:
            channel.poll()  # a decode spinning here took one of two cores from the WRITE
            for messages in agent.get_new_notifs().values():
                done = done or want in messages
            if not done:
                time.sleep(NOTIF_POLL_S)
        conn.send(time.perf_counter() - start)
    channel.close()
    agent.deregister_memory(reg)


class Rig:
    """The worker's ``VllmBackend`` serving push over ``regions`` and a decode process as in
    the module docstring, the decode handshaken: ``once`` pushes one request."""

    def __init__(self, regions: Any, direct: bool = False) -> None:
        """``direct``: ``regions`` is a vllm_blocks pool, served from its pages themselves
        (``transfer/vllm/direct.py``): each request pins scattered pages of it, as a
        finished request's pages are pinned, and the WRITE's end unpins them."""
        from prefill_worker.kv.pages import PagePool
        from prefill_worker.kv.pins import PagePins
        from prefill_worker.transfer.options import NixlOptions, VllmOptions
        from prefill_worker.transfer.vllm.backend import VllmBackend
        from prefill_worker.transfer.vllm.channel import our_hash, serve_side_channels
        from prefill_worker.transfer.vllm.profiles import PUSH
        from prefill_worker.transfer.vllm.tickets import Tickets

        nixl = NixlOptions(None, ("UCX",), "lo")
        num_blocks = max(TOKENS) // BLOCK_SIZE
        options = VllmOptions(
            "127.0.0.1", 0, BLOCK_SIZE, num_blocks, versions=(VERSION,), modes=(PUSH,), nixl=nixl
        )
        self.tickets = Tickets(4, (VERSION,), (PUSH,))
        self.pages: PagePool | None = None
        pins = None
        if direct:  # every page in use, as requests' pages are: pins go on top
            self.pages = PagePool(regions.layout.num_pages)
            assert self.pages.try_alloc(regions.layout.num_pages) is not None
            pins = PagePins(self.pages)
        self.pins = pins
        self.backend = backend = VllmBackend(
            regions, options, self.tickets, serve_side_channels, pins=pins
        )
        assert (backend.direct is not None) == direct
        push_hash = our_hash(backend.registration, VERSION, PUSH)
        port = backend.desk.identities[f"{VERSION}+push"].side_channel_port
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        args = (child_conn, backend.registration, push_hash, port)
        self.child = ctx.Process(target=decode_main, args=args, daemon=True)
        self.child.start()
        self.rng = np.random.default_rng(7)
        self.room = 1
        while not self.conn.poll(0.001):
            backend.poll()  # the decode's handshake
        ready, self.decode_blocks = self.conn.recv()
        assert ready == "ready"
        for layer in backend.mirror_layers:  # written, as the forwards write them
            layer.view(np.uint8).fill(7)
        self.layout = backend.desk.staging.layout
        self.source = "staging" if backend.direct is None else "pool"

    def once(self, tokens: int) -> tuple[float, float]:
        """(seconds from the decode's registration to its notification, the WRITE's
        seconds) for one request of ``tokens`` held as a finished one is."""
        from prefill_worker.transfer.vllm.profiles import PUSH
        from prefill_worker.transfer.vllm.push import push_key

        backend, pusher = self.backend, self.backend.pusher
        assert pusher is not None
        self.room += 1
        external = secrets.token_hex(8)
        assert self.tickets.open(self.room, VERSION, PUSH, push_key(external))
        if self.pins is not None:  # scattered pool pages, pinned as a DirectSender pins
            n = self.layout.num_blocks_for(tokens)
            blocks = tuple(_scattered(self.rng, self.layout.num_blocks, n))
            self.pins.pin(blocks)
        else:
            blocks = backend.desk.try_allocate(tokens)
        assert blocks is not None
        assert backend.desk.hold(self.room, blocks, tokens)
        self.tickets.take(self.room)
        local = _scattered(self.rng, self.decode_blocks, len(blocks))
        written_s, pushed = pusher.counts.write_s, pusher.counts.pushed
        self.conn.send(("push", f"cmpl-{external}-0-{secrets.token_hex(4)}", local))
        while not self.conn.poll(0):  # as the engine turns: poll, then sleep until the next
            backend.poll()  # turn it asks for (1 ms while the registration is awaited) or a
            backend.wait(0.01, self.conn.fileno())  # wake (the WRITE's transfer thread)
        elapsed = self.conn.recv()
        while pusher.busy:
            backend.poll()
            backend.wait(0.01)
        assert pusher.counts.pushed == pushed + 1
        assert self.pins is None or self.pins.num_pinned == 0  # the WRITE's end unpinned them
        return elapsed, pusher.counts.write_s - written_s

    def close(self) -> None:
        self.conn.send(("exit",))
        self.child.join(10)
        self.backend.close()


def run(
    regions: Any, pool_layout: str, repeats: int, native_gb_s: dict[int, float], pool: np.ndarray
) -> None:
    """One row per prompt length (module docstring), printed."""
    import json

    rig = Rig(regions)
    lay = rig.layout
    copy_dst = np.ones(lay.num_layers * rig.decode_blocks * lay.block_bytes, np.uint8)
    try:
        for tokens in TOKENS:
            nbytes = tokens * lay.token_bytes
            times, copies, writes = [], [], []
            for _ in range(repeats + 1):  # the first is a warm-up (the worker's handshake)
                elapsed, write_s = rig.once(tokens)
                times.append(elapsed)
                writes.append(write_s)
                copies.append(_memcpy_s(pool, copy_dst, nbytes))
            gb_s = nbytes / statistics.median(times[1:]) / 1e9
            ref = nbytes / statistics.median(copies[1:]) / 1e9
            native = native_gb_s.get(tokens)
            row = {
                "name": "transfer",
                "protocol": "vllm-push",
                "pool_layout": pool_layout,
                "source": rig.source,
                "tokens": tokens,
                "layout": "scattered",
                "gb_s": round(gb_s, 3),
                "memcpy_gb_s": round(ref, 3),
                "ratio": round(gb_s / ref, 3),
                "native_push_gb_s": native,
                "vllm_push_vs_native": None if not native else round(gb_s / native, 3),
                "write_ms": round(statistics.median(writes[1:]) * 1e3, 3),
                "registered_to_notified_ms": round(statistics.median(times[1:]) * 1e3, 3),
                "descriptors": lay.num_layers * tokens // BLOCK_SIZE,
                "descriptor_bytes": lay.block_bytes,
                "load_avg": round(os.getloadavg()[0], 2),
            }
            print(json.dumps(row), flush=True)
    finally:
        rig.close()


def _scattered(rng: np.random.Generator, num_total: int, n: int) -> list[int]:
    while True:
        picked = rng.choice(num_total, n, replace=False)
        if not np.any(np.abs(np.diff(picked)) == 1):
            return [int(b) for b in picked]


def _memcpy_s(src: np.ndarray, dst: np.ndarray, nbytes: int) -> float:
    start = time.perf_counter()
    np.copyto(dst[:nbytes], src[:nbytes])
    return time.perf_counter() - start
