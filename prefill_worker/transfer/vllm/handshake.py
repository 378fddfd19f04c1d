"""vLLM's NIXL handshake, prefill side, without vLLM: the compatibility hash, the agent
metadata a vLLM decode decodes, and the ZMQ side channel that serves them.

A vLLM decode (its ``NixlConnector`` in the consumer role) pulls KV with NIXL READs. Before
its first READ from an engine it asks that engine's side channel for the metadata::

    decode (REQ)                                   prefill (ROUTER, port base + dp index)
      msgpack((b"get_meta_msg", pp_rank, tp_rank))  ->
                                                   <-  frame 1: msgpack map
                                                         {compatibility_hash: str,
                                                          agent_metadata_bytes: bytes}
                                                       frame 2: msgpack(time.perf_counter())

``agent_metadata_bytes`` is vLLM's ``NixlAgentMetadata`` as msgspec encodes it (a map, keys
in field order, connector version 15). The decode compares the hash with its own before it
decodes the metadata; a mismatch fails its handshake. The second frame lets the decode
estimate our clock, against which ``remote_blocks_expiry_time`` is stamped: it must be this
process's ``perf_counter``.

Hostile input: a message larger than ``MAX_REQUEST_BYTES``, of the wrong frame count, not the
msgpack triple above, or for a rank this engine does not serve, is counted by reason and left
unanswered (the decode's own 5 s receive timeout fails its handshake); nothing else changes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq

VLLM_VERSION = "0.33.0"
NIXL_CONNECTOR_VERSION = 15
GET_META_MSG = b"get_meta_msg"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
MAX_REQUEST_BYTES = 256  # the triple is ~20 bytes; anything larger is not a decode


@dataclass(frozen=True, slots=True)
class CompatFactors:
    """What vLLM 0.33 hashes (``compute_nixl_compatibility_hash``), as the decode sees it.

    ``model`` is the decode's model string (its ``--model``), ``dtype`` torch's name
    (``"float32"`` -> hashed as ``"torch.float32"``). ``attn_backend_name`` is the decode's:
    ``FLASH_ATTN`` on GPU, ``CPU_ATTN`` on CPU.
    """

    model: str
    dtype: str
    num_kv_heads: int
    head_size: int
    num_layers: int
    attn_backend_name: str = "FLASH_ATTN"
    cache_dtype: str = "auto"
    is_hma_enabled: bool = True
    transfer_mode: str = "pull"
    vllm_version: str = VLLM_VERSION
    connector_version: int = NIXL_CONNECTOR_VERSION


def compat_hash(factors: CompatFactors) -> str:
    """SHA-256 hex of ``json.dumps(factors, sort_keys=True)``, vLLM 0.33's exact factors
    (speculative decoding unsupported: its factor is ``None``)."""
    items = {
        "vllm_version": factors.vllm_version,
        "nixl_connector_version": factors.connector_version,
        "model": factors.model,
        "dtype": f"torch.{factors.dtype.removeprefix('torch.')}",
        "num_kv_heads": factors.num_kv_heads,
        "head_size": factors.head_size,
        "num_hidden_layers": factors.num_layers,
        "attn_backend_name": factors.attn_backend_name,
        "cache_dtype": factors.cache_dtype,
        "is_hma_enabled": factors.is_hma_enabled,
        "speculative_config": None,
        "transfer_mode": factors.transfer_mode,
    }
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


class NixlAgentMetadata(msgspec.Struct):
    """vLLM 0.33's ``NixlAgentMetadata``: same field names, same order, same defaults, so
    that msgspec writes the bytes vLLM's own encoder writes. One region per layer
    (``kv_caches_base_addr``, ``block_lens``, ``block_strides``, ``region_*`` in step)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class HandshakePayload(msgspec.Struct):
    """vLLM's ``NixlHandshakePayload``: the first reply frame."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


@dataclass(frozen=True, slots=True)
class LayerRegion:
    """One registered layer, vLLM's LBHNC: ``[num_blocks, kv_heads, block_size, 2*head_dim]``,
    K‖V per (head, token); block ``b`` at ``base_addr + b * block_bytes``."""

    name: str
    base_addr: int
    block_bytes: int


def agent_metadata(
    engine_id: str,
    agent_blob: bytes,
    layers: list[LayerRegion],
    num_blocks: int,
    block_size: int,
    attn_backend_name: str,
    mem_type: str = "DRAM",
) -> NixlAgentMetadata:
    """The metadata of one TP rank whose layers are contiguous LBHNC regions (no mamba, no
    PLE, no packed members; one KV-cache group), as vLLM's worker writes it for itself."""
    return NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent_blob,
        kv_caches_base_addr=[layer.base_addr for layer in layers],
        device_id=0,
        num_blocks=num_blocks,
        block_lens=[layer.block_bytes for layer in layers],
        block_strides=[layer.block_bytes for layer in layers],
        kv_cache_layout="LBHNC",
        block_size=block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=attn_backend_name,
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[num_blocks] * len(layers),
        region_group_ids=[0] * len(layers),
        region_names=[layer.name for layer in layers],
        region_mem_types=[mem_type] * len(layers),
    )


def encode_payload(compatibility_hash: str, metadata: NixlAgentMetadata) -> bytes:
    """The first reply frame for one rank."""
    inner = msgspec.msgpack.encode(metadata)
    return msgspec.msgpack.encode(HandshakePayload(compatibility_hash, inner))


def side_channel_port(base_port: int, dp_rank: int) -> int:
    """vLLM's rule: the decode dials ``remote_port``, the base plus the engine's dp index."""
    return base_port + dp_rank


_request_decoder = msgspec.msgpack.Decoder(tuple[bytes, int, int])


@dataclass(slots=True)
class SideChannelStats:
    num_served: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # reason -> count


class SideChannel:
    """The ZMQ ROUTER a vLLM decode handshakes with. ``payloads`` maps (pp_rank, tp_rank) to
    the first reply frame (``encode_payload``); ``set_payload`` replaces one (a changed
    registration). ``poll()`` answers what is pending and never blocks; ``serve(timeout_ms)``
    waits up to that long for the first message. ``port``: the port bound (asked 0: the one
    the kernel picked, with no window for another process to take it first)."""

    def __init__(self, host: str, port: int, payloads: dict[tuple[int, int], bytes]) -> None:
        self._payloads = dict(payloads)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES * 4)
        try:
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise
        endpoint: object = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.port = int(endpoint.rsplit(b":", 1)[1])
        self.stats = SideChannelStats()

    def set_payload(self, pp_rank: int, tp_rank: int, payload: bytes) -> None:
        self._payloads[(pp_rank, tp_rank)] = payload

    def serve(self, timeout_ms: int) -> int:
        """Answers every pending message, waiting up to ``timeout_ms`` for one; -> handled."""
        if not self._sock.poll(timeout_ms):
            return 0
        return self.poll()

    def poll(self) -> int:
        num_handled = 0
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return num_handled
            self._handle(frames)
            num_handled += 1

    def close(self) -> None:
        self._sock.close(linger=0)

    def _handle(self, frames: list[bytes]) -> None:
        reason, reply = self._answer(frames)
        if reply is None:
            self.stats.refused[reason] += 1
            return
        ts = msgspec.msgpack.encode(time.perf_counter())
        self._sock.send_multipart([frames[0], b"", reply, ts])
        self.stats.num_served += 1

    def _answer(self, frames: list[bytes]) -> tuple[str, bytes | None]:
        """-> ("", reply) or (reason refused, None)."""
        if len(frames) != 3 or frames[1] != b"":
            return "frames", None
        if len(frames[2]) > MAX_REQUEST_BYTES:
            return "too_large", None
        try:
            msg, pp_rank, tp_rank = _request_decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "malformed", None
        if msg != GET_META_MSG:
            return "unknown_message", None
        payload = self._payloads.get((pp_rank, tp_rank))
        if payload is None:
            return "unknown_rank", None
        return "", payload
