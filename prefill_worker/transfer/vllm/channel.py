"""The vLLM side channels as the backend starts them: one ``handshake.SideChannel`` (a ZMQ
ROUTER) per vLLM version served, each answering ``get_meta_msg`` for rank (0, 0) with that
version's compatibility hash and ``NixlAgentMetadata`` of the same staging registration (one
LBHNC region per layer, one TP rank, dp index 0). The backend turns them in ``poll``.

A push decode (vLLM's ``NixlPushConnector``) hashes ``transfer_mode`` "push": each version a
worker pushes to gets a second channel, after the pulls' (``profiles.channel_key``).

A decode's handshake names no version (``(b"get_meta_msg", pp_rank, tp_rank)`` in 0.33 and
0.34 alike) and its hash check is exact, so one port cannot serve two versions: version ``i``
of ``versions`` is served on ``port + i`` (port 0: each a port the kernel picks), and the
answer a request gets names the port of the version it asked for (``desk.PullIdentity``).
"""

from __future__ import annotations

from collections.abc import Mapping

from prefill_worker.transfer.vllm.backend import PullRegistration, our_hash
from prefill_worker.transfer.vllm.handshake import (
    SideChannel,
    encode_payload,
)
from prefill_worker.transfer.vllm.profiles import (
    PROFILES,
    PULL,
    LayerRegion,
    agent_metadata,
    channel_key,
)


class VersionedSideChannels:
    """One bound ``handshake.SideChannel`` per version; ``ports`` maps each version to the
    port it bound."""

    def __init__(self, host: str, port: int, payloads: Mapping[str, bytes]) -> None:
        self._channels: dict[str, SideChannel] = {}
        try:
            for index, (version, payload) in enumerate(payloads.items()):
                at = port + index if port else 0
                self._channels[version] = SideChannel(host, at, {(0, 0): payload})
        except BaseException:
            self.close()
            raise
        self.ports: Mapping[str, int] = {v: c.port for v, c in self._channels.items()}

    def poll(self) -> int:
        return sum(channel.poll() for channel in self._channels.values())

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def serve_side_channels(
    host: str, port: int, registration: PullRegistration
) -> VersionedSideChannels:
    """The side channels bound from ``host:port`` on, one per ``registration.versions`` and
    mode (``registration.modes``: the pulls' first, on the ports they had before push was
    served, then the pushes'), keyed by ``profiles.channel_key``."""
    payloads = {
        channel_key(v, mode): handshake_payload(registration, v, mode)
        for mode in registration.modes
        for v in registration.versions
    }
    return VersionedSideChannels(host, port, payloads)


def handshake_payload(registration: PullRegistration, version: str, mode: str = PULL) -> bytes:
    """The reply a decode of ``version`` in ``mode`` gets: the hash of our shape as it sees
    its own, then the metadata of the staging region in its version's fields."""
    profile = PROFILES[version]
    identity = registration.identity
    groups = registration.layer_groups
    regions = [
        *zip(groups.kv_layers, registration.region_base_addrs, strict=True),
        *zip(groups.state_layers, registration.state_base_addrs, strict=True),
    ]
    layers = [
        LayerRegion(groups.names[i], addr, registration.block_bytes, groups.layer_group[i])
        for i, addr in regions
    ]
    metadata = agent_metadata(
        profile,
        registration.engine_id,
        registration.agent_metadata,
        layers,
        registration.num_blocks,
        registration.block_size,
        identity.attention_backend,
        ssm_sizes=registration.ssm_sizes,
    )
    return encode_payload(our_hash(registration, version, mode), metadata)
