"""A bare vLLM-shaped decode for tests: what vLLM 0.33's NixlConnector does against a
prefill, with NIXL and ZMQ only: ``handshake`` (``get_meta_msg`` on the side channel: the
hash and the decoded ``NixlAgentMetadata``), then ``PullDecode.read`` (one NIXL READ of the
named blocks of every layer, with the notification ``<remote_request_id>:<consumers>``) or
``notify`` (``HB:`` heartbeats, notification-only releases). vLLM's own connector against the
worker is tests/interop's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from prefill_worker.transfer.vllm.handshake import HandshakePayload
from prefill_worker.transfer.vllm.profiles import NixlAgentMetadataV16 as NixlAgentMetadata
from tests.polling import wait_until


def handshake(
    host: str, port: int, turn: Callable[[], None] = lambda: None
) -> tuple[str, NixlAgentMetadata]:
    """The hash and the metadata; ``turn`` is called while waiting (an in-process backend's
    ``poll``; a worker process answers by itself)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")

    def answered() -> bool:
        turn()
        return sock.poll(0) != 0

    try:
        sock.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
        wait_until(answered, 10.0, "the side channel's answer")
        payload, _clock = sock.recv_multipart()
    finally:
        sock.close()
    reply = msgspec.msgpack.decode(payload, type=HandshakePayload)
    # v16's fields, a superset of v15's (a v15 payload decodes with layer_group_ids empty)
    meta = msgspec.msgpack.decode(reply.agent_metadata_bytes, type=NixlAgentMetadata)
    return reply.compatibility_hash, meta


class PullDecode:
    """One NIXL agent with a buffer of ``num_blocks`` blocks per layer, peered with the
    prefill whose metadata it was given."""

    def __init__(self, meta: NixlAgentMetadata, name: str = "test-vllm-decode") -> None:
        from prefill_worker.transfer.nixl.agent import make_agent

        self.meta = meta
        self.num_layers = len(meta.kv_caches_base_addr)
        # NIXL's progress thread on, as vLLM's connector runs its agent: notifications (`notify`)
        # leave without anything else driving this agent.
        self.agent: Any = make_agent(name, ["UCX"], "lo", progress_thread=True)
        self.buffer = np.zeros(self.num_layers * meta.num_blocks * meta.block_lens[0], np.uint8)
        table = np.array([[self.buffer.ctypes.data, self.buffer.nbytes, 0]], dtype=np.uint64)
        self.registered = self.agent.register_memory(table, "DRAM")
        self.peer = self.agent.add_remote_agent(meta.agent_metadata)

    def read(self, block_ids: list[int], notif: str) -> np.ndarray:
        """The blocks' bytes, [layers, len(block_ids), block bytes] (uint8)."""
        size, n = self.meta.block_lens[0], len(block_ids)
        remote = [
            (base + b * size, size, 0) for base in self.meta.kv_caches_base_addr for b in block_ids
        ]
        base = self.buffer.ctypes.data
        local = [(base + i * size, size, 0) for i in range(self.num_layers * n)]
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(remote, "DRAM"),
            self.peer,
            notif.encode(),
        )
        assert self.agent.transfer(handle) in ("PROC", "DONE")
        wait_until(lambda: self.agent.check_xfer_state(handle) == "DONE", 10.0, "the READ")
        self.agent.release_xfer_handle(handle)
        return self.buffer[: self.num_layers * n * size].reshape(self.num_layers, n, size).copy()

    def notify(self, message: str) -> None:
        self.agent.send_notif(self.peer, message.encode())

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.registered)
