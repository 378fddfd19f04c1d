"""Picks the transfer backend at start-up, for the daemon (the only caller that sees config)."""

from __future__ import annotations

import uuid
from typing import Literal, Protocol

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.base import KVSender


class ServingBackend(Protocol):
    """A TransferBackend that also says where decode peers reach its bootstrap server."""

    bootstrap_endpoint: str

    def create_sender(self, room: int, request_id: str, num_prompt_tokens: int) -> KVSender: ...

    def poll(self) -> None: ...

    def close(self) -> None: ...


def make_backend(
    kind: Literal["nixl", "loopback"],
    regions: KVRegions,
    bootstrap_bind: str,
    agent_name: str | None,
    nixl_backends: list[str],
    peer_timeout_s: float,
    heartbeat_interval_s: float,
    want_timeout_s: float = 30.0,
) -> ServingBackend:
    """``nixl``: the real backend, its bootstrap server bound (``bootstrap_endpoint`` is the
    actual address, port 0 allowed). ``loopback``: the in-process test backend.

    Raises ``OSError`` when the bootstrap address cannot be bound, and NIXL's own errors (or
    ``RuntimeError``) when no agent can be made."""
    if kind == "loopback":
        from prefill_worker.transfer.loopback import LoopbackBackend

        return LoopbackBackend(regions)
    from prefill_worker.transfer.nixl_backend import NixlBackend

    return NixlBackend(
        regions,
        bootstrap_bind,
        agent_name or f"prefill-{uuid.uuid4().hex[:12]}",
        nixl_backends,
        peer_timeout_s,
        heartbeat_interval_s,
        want_timeout_s,
    )
