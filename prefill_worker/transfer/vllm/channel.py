"""The vLLM side channel as the backend starts it: ``handshake``'s ZMQ ROUTER, serving the
compatibility hash and the ``NixlAgentMetadata`` of the staging registration (one LBHNC
region per layer, one TP rank, dp index 0). The backend turns it in ``poll``."""

from __future__ import annotations

from prefill_worker.transfer.vllm.backend import PullRegistration
from prefill_worker.transfer.vllm.handshake import (
    CompatFactors,
    LayerRegion,
    SideChannel,
    agent_metadata,
    compat_hash,
    encode_payload,
)


class BoundSideChannel:
    """``handshake.SideChannel`` serving one payload, with the port it bound (port 0: the
    kernel's pick)."""

    def __init__(self, host: str, port: int, payload: bytes) -> None:
        self._channel = SideChannel(host, port, {(0, 0): payload})
        self.port = self._channel.port

    @property
    def stats(self) -> object:
        return self._channel.stats

    def poll(self) -> int:
        return self._channel.poll()

    def close(self) -> None:
        self._channel.close()


def serve_side_channel(host: str, port: int, registration: PullRegistration) -> BoundSideChannel:
    """The side channel bound on ``host:port``, answering ``get_meta_msg`` for rank (0, 0)."""
    return BoundSideChannel(host, port, handshake_payload(registration))


def handshake_payload(registration: PullRegistration) -> bytes:
    """The reply a decode gets: the hash of our shape as the decodes see theirs, then the
    metadata of the staging region."""
    lay, identity = registration.layout, registration.identity
    factors = CompatFactors(
        model=identity.model,
        dtype=registration.dtype,
        num_kv_heads=lay.num_kv_heads,
        head_size=lay.head_dim,
        num_layers=lay.num_layers,
        attn_backend_name=identity.attention_backend,
    )
    layers = [
        LayerRegion(f"model.layers.{i}.self_attn.attn", addr, registration.block_bytes)
        for i, addr in enumerate(registration.region_base_addrs)
    ]
    metadata = agent_metadata(
        registration.engine_id,
        registration.agent_metadata,
        layers,
        registration.num_blocks,
        registration.block_size,
        identity.attention_backend,
    )
    return encode_payload(compat_hash(factors), metadata)
