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
in field order; its fields per connector version in ``profiles``). The decode compares the
hash with its own before it decodes the metadata; a mismatch fails its handshake. The second
frame lets the decode estimate our clock, against which ``remote_blocks_expiry_time`` is
stamped: it must be this process's ``perf_counter``.

Hostile input: a message larger than ``MAX_REQUEST_BYTES``, of the wrong frame count, not the
msgpack triple above, or for a rank this engine does not serve, is counted by reason and left
unanswered (the decode's own 5 s receive timeout fails its handshake); nothing else changes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import msgspec
import zmq

from prefill_worker.transfer.vllm.profiles import NixlAgentMetadata, VllmProfile

GET_META_MSG = b"get_meta_msg"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
MAX_REQUEST_BYTES = 256  # the triple is ~20 bytes; anything larger is not a decode


@dataclass(frozen=True, slots=True)
class CompatFactors:
    """What vLLM hashes (``compute_nixl_compatibility_hash``, the same factors in 0.33 and
    0.34), as the decode sees it; ``vllm_version`` and ``connector_version`` are its
    profile's (``for_profile``).

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
    vllm_version: str = "0.33.0"
    connector_version: int = 15

    def for_profile(self, profile: VllmProfile) -> CompatFactors:
        """These factors as a decode of ``profile``'s version hashes them."""
        return replace(
            self, vllm_version=profile.version, connector_version=profile.connector_version
        )


def compat_hash(factors: CompatFactors) -> str:
    """SHA-256 hex of ``json.dumps(factors, sort_keys=True)``, vLLM 0.33's and 0.34's exact
    factors (speculative decoding unsupported: its factor is ``None``)."""
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


class HandshakePayload(msgspec.Struct):
    """vLLM's ``NixlHandshakePayload``: the first reply frame."""

    compatibility_hash: str
    agent_metadata_bytes: bytes


def encode_payload(compatibility_hash: str, metadata: NixlAgentMetadata) -> bytes:
    """The first reply frame for one rank (``metadata`` as its profile's version has it)."""
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
