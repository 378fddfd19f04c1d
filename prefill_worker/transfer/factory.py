"""Picks the transfer backend at start-up, for the daemon (the only caller that sees config)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Protocol

from prefill_worker.curve import CurveServerKeys
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.base import KVSender
from prefill_worker.transfer.validate import BootstrapLimits


class ServingBackend(Protocol):
    """A TransferBackend that also says where decode peers reach its bootstrap server."""

    bootstrap_endpoint: str

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender: ...

    def poll(self) -> None: ...

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None: ...

    def close(self) -> None: ...


def make_backend(
    regions: KVRegions,
    bootstrap_bind: str,
    agent_name: str | None,
    nixl_backends: list[str],
    peer_timeout_s: float,
    heartbeat_interval_s: float,
    want_timeout_s: float = 30.0,
    *,
    limits: BootstrapLimits | None = None,
    curve: CurveServerKeys | None = None,
    ucx_net_devices: str | None = None,
    on_reject: Callable[[str], None] | None = None,
    push_thread: bool = True,
) -> ServingBackend:
    """The NIXL backend, its bootstrap server bound (``bootstrap_endpoint`` is the actual
    address, port 0 allowed). No fake is selectable here: nothing in production config can
    pick one (the scheduler's tests fake the seam in ``tests/unit/scheduler/fakes.py``).
    ``limits`` bound what a decode peer may register and send; ``curve`` turns on CurveZMQ
    with an allow-list on the bootstrap socket; ``ucx_net_devices`` picks UCX's interfaces;
    ``on_reject(reason)`` counts each refused bootstrap message (engine thread);
    ``push_thread`` False posts writes on the engine thread (what the benchmarks compare the
    transfer thread with; nothing in production config selects it).

    Raises ``OSError`` when the bootstrap address cannot be bound, and NIXL's own errors (or
    ``RuntimeError``) when no agent can be made."""
    from prefill_worker.transfer.nixl.backend import NixlBackend
    from prefill_worker.transfer.nixl.poster import InlinePoster
    from prefill_worker.transfer.nixl.push_thread import PushThread

    return NixlBackend(
        regions,
        bootstrap_bind,
        agent_name or f"prefill-{uuid.uuid4().hex[:12]}",
        nixl_backends,
        peer_timeout_s,
        heartbeat_interval_s,
        want_timeout_s,
        limits=limits,
        curve=curve,
        ucx_net_devices=ucx_net_devices,
        on_reject=on_reject,
        poster_factory=PushThread if push_thread else InlinePoster,
    )
