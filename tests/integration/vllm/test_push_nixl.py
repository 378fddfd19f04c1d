"""vLLM's push mode over real NIXL (UCX on loopback) and the real side channels (ZMQ), the
decode played by a bare NIXL agent doing what vLLM's push decode does on the wire: its own
side channel answering with the push hash, a handshake with the worker's push side channel,
the ``PUSH_REG`` notification, then a wait for ``"<id>:1"``. The worker's WRITE comes from
the push side's own agent on its transfer thread (``nixl-push-vllm``), which wakes the
engine when it settles; the bytes are the staged blocks, byte-exact, and every staging block
is back afterwards. (vLLM's own push decodes against the worker: tests/interop.)"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import msgspec
import numpy as np
import torch

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.nixl.agent import make_agent
from prefill_worker.transfer.options import Hooks, NixlOptions, VllmIdentity, VllmOptions
from prefill_worker.transfer.vllm.backend import VllmBackend, our_hash
from prefill_worker.transfer.vllm.channel import serve_side_channels
from prefill_worker.transfer.vllm.handshake import HandshakePayload, SideChannel, encode_payload
from prefill_worker.transfer.vllm.link import fetch_payload
from prefill_worker.transfer.vllm.profiles import PROFILES, PUSH, LayerRegion, agent_metadata
from prefill_worker.transfer.vllm.push import PUSH_REG_PREFIX, push_key
from prefill_worker.transfer.vllm.tickets import Tickets
from tests.polling import wait_until

L, H, D, PS, PAGES, BS, BLOCKS, DECODE_BLOCKS = 2, 2, 8, 16, 40, 32, 12, 10
VERSION = "0.34.0"


def test_a_push_decode_gets_the_staged_blocks_from_the_transfer_thread() -> None:
    pool = torch.randn(L, 2, PAGES, PS, H, D)
    lay = KVLayout(L, H, D, "float32", PS, PAGES)
    k = tuple(pool[i, 0].data_ptr() for i in range(L))
    v = tuple(pool[i, 1].data_ptr() for i in range(L))
    identity = VllmIdentity("tiny-llama", "CPU_ATTN")
    options = VllmOptions(
        "127.0.0.1",
        0,
        BS,
        BLOCKS,
        versions=(VERSION,),
        modes=(PUSH,),
        identity=identity,
        nixl=NixlOptions(None, ("UCX",), "lo"),
    )
    wakes = threading.Semaphore(0)
    tickets = Tickets(4, (VERSION,), (PUSH,))
    backend = VllmBackend(
        KVRegions(lay, k, v, "cpu", 0, 0),
        options,
        tickets,
        serve_side_channels,
        Hooks(wake=wakes.release),
    )
    staging = backend.desk.staging
    capacity = staging.num_free
    rng = np.random.default_rng(0)
    for layer in backend.mirror_layers:  # the blocks, as the forwards' mirror writes them
        flat = layer.view(np.uint8).reshape(-1)
        flat[:] = rng.integers(0, 256, flat.size, np.uint8)
    block_bytes = staging.layout.block_bytes
    blocks = np.zeros(L * DECODE_BLOCKS * block_bytes, np.uint8)
    agent: Any = make_agent("test-vllm-push-decode", ["UCX"], "lo", progress_thread=True)
    registered = agent.register_memory(
        np.array([[blocks.ctypes.data, blocks.nbytes, 0]], np.uint64), "DRAM"
    )
    bases = [blocks.ctypes.data + i * DECODE_BLOCKS * block_bytes for i in range(L)]
    layers = [
        LayerRegion(f"model.layers.{i}.self_attn.attn", b, block_bytes) for i, b in enumerate(bases)
    ]
    meta = agent_metadata(
        PROFILES[VERSION],
        "decode-1",
        agent.get_agent_metadata(),
        layers,
        DECODE_BLOCKS,
        BS,
        "CPU_ATTN",
    )
    push_hash = our_hash(backend.registration, VERSION, PUSH)
    channel = SideChannel("127.0.0.1", 0, {(0, 0): encode_payload(push_hash, meta)})
    try:
        port = backend.desk.identities[f"{VERSION}+push"].side_channel_port
        answered: list[bytes] = []
        thread = threading.Thread(target=lambda: answered.append(fetch_payload("127.0.0.1", port)))
        thread.start()
        wait_until(lambda: (backend.poll(), not thread.is_alive())[1], 10.0, "the handshake")
        ours = msgspec.msgpack.decode(
            msgspec.msgpack.decode(answered[0], type=HandshakePayload).agent_metadata_bytes
        )
        prefill = agent.add_remote_agent(ours["agent_metadata"])
        # the prefill's request, finished and held as a push (3 blocks of 32 tokens)
        external = secrets.token_hex(4)
        assert tickets.open(1, VERSION, PUSH, push_key(external))
        held = backend.desk.try_allocate(3 * BS)
        assert held is not None and backend.desk.hold(1, held, 3 * BS)
        tickets.take(1)
        theirs = [7, 2, 5]
        request_id = f"cmpl-{external}-0-{secrets.token_hex(4)}"
        body = {
            "request_id": request_id,
            "decode_engine_id": "decode-1",
            "decode_host": "127.0.0.1",
            "decode_port": channel.port,
            "decode_tp_size": 1,
            "local_block_ids": [theirs],
        }
        agent.send_notif(prefill, PUSH_REG_PREFIX + msgspec.msgpack.encode(body))
        got: dict[str, list[bytes]] = {}

        def notified() -> bool:
            backend.poll()
            channel.poll()  # the worker's link handshake
            for name, messages in agent.get_new_notifs().items():
                got.setdefault(name, []).extend(messages)
            return not backend.pusher.busy and bool(got)  # type: ignore[union-attr]

        wait_until(notified, 20.0, "the WRITE's notification")
        push_agent = f"{backend.registration.engine_id}-push"
        assert got == {push_agent: [f"{request_id}:1".encode()]}  # the push side's agent
        assert wakes.acquire(timeout=0)  # the transfer thread woke the engine
        written = blocks.reshape(L, DECODE_BLOCKS, block_bytes)
        for layer in range(L):
            staged = backend.mirror_layers[layer].view(np.uint8).reshape(BLOCKS, block_bytes)
            for ours_b, theirs_b in zip(held, theirs, strict=True):
                assert np.array_equal(written[layer, theirs_b], staged[ours_b])
        assert backend.pusher is not None and backend.pusher.counts.pushed == 1
        assert staging.num_free == capacity  # the WRITE's end freed the request's blocks
        agent.remove_remote_agent(prefill)
    finally:
        channel.close()
        agent.deregister_memory(registered)
        backend.close()
    assert staging.num_free == capacity
