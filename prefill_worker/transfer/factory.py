"""Picks the transfer backends at start-up, for the daemon (the only caller that sees config):
the native bootstrap protocol (``make_backend``), SGLang's (``make_sglang_backend``), or both
(``serve_protocols``)."""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prefill_worker.curve import CurveServerKeys
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.base import KVSender
from prefill_worker.transfer.dual import DualBackend, NamedBackend
from prefill_worker.transfer.validate import BootstrapLimits


class ServingBackend(Protocol):
    """A TransferBackend that also says where decode peers reach its bootstrap server."""

    bootstrap_endpoint: str

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender: ...

    def poll(self) -> None: ...

    def next_poll_at(self) -> float: ...

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
    is_engine_live: Callable[[], bool] = lambda: True,
) -> ServingBackend:
    """The NIXL backend, its bootstrap server bound (``bootstrap_endpoint`` is the actual
    address, port 0 allowed). No fake is selectable here: nothing in production config can
    pick one (the scheduler's tests fake the seam in ``tests/unit/scheduler/fakes.py``).
    ``limits`` bound what a decode peer may register and send; ``curve`` turns on CurveZMQ
    with an allow-list on the bootstrap socket; ``ucx_net_devices`` picks UCX's interfaces;
    ``on_reject(reason)`` counts each refused bootstrap message (engine thread);
    ``push_thread`` False posts writes on the engine thread (what the benchmarks compare the
    transfer thread with; nothing in production config selects it); heartbeats to decode
    peers stop while ``is_engine_live`` (the daemon's liveness verdict) says it is stuck.

    Raises ``OSError`` when the bootstrap address cannot be bound, and NIXL's own errors (or
    ``RuntimeError``) when no agent can be made."""
    from prefill_worker.transfer.native.backend import NixlBackend
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
        is_engine_live=is_engine_live,
    )


@dataclass(frozen=True, slots=True)
class SglangBootstrap:
    """Where SGLang decodes reach this worker (``transfer.protocol`` sglang or both)."""

    http_bind: str  # host:port of /route and /health: the router's `--prefill URL PORT`
    rank_ip: str  # the control socket's address, as /route names it (an address decodes reach)
    rank_port: int  # 0: any free port
    kv_cache_dtype: str  # what /route announces; must equal the decodes' --kv-cache-dtype
    health_stale_s: float  # /health fails once the engine has not turned for this long
    allowed_networks: tuple[str, ...] = ()  # decodes' source networks (CIDR); empty: any
    rejoin_s: float = 0.0  # /health and /route answer 503 this long after the first turn


@dataclass(frozen=True, slots=True)
class Transfer:
    """The backend the engine drives, and what it bound (for ``/readyz`` and the ready file)."""

    backend: ServingBackend
    endpoints: Mapping[str, str]


def make_sglang_backend(
    regions: KVRegions,
    sglang: SglangBootstrap,
    agent_name: str | None,
    nixl_backends: list[str],
    write_timeout_s: float,
    want_timeout_s: float,
    *,
    limits: BootstrapLimits | None = None,
    ucx_net_devices: str | None = None,
    on_reject: Callable[[str], None] | None = None,
    wake: Callable[[], None] | None = None,
    is_engine_live: Callable[[], bool] = lambda: True,
) -> NamedBackend:
    """This worker as an SGLang prefill (``transfer/sglang``): the bootstrap routes and the
    control socket bound, a NIXL agent of its own. ``wake`` is called from the control
    thread whenever a message arrives (the engine's inbox, when it sleeps elsewhere)."""
    from prefill_worker.transfer.sglang.backend import SglangBackend

    return SglangBackend(
        regions,
        sglang.http_bind,
        sglang.rank_ip,
        sglang.rank_port,
        sglang.kv_cache_dtype,
        agent_name or f"prefill-sglang-{uuid.uuid4().hex[:12]}",
        nixl_backends,
        write_timeout_s,
        want_timeout_s,
        health_stale_s=sglang.health_stale_s,
        rejoin_s=sglang.rejoin_s,
        is_engine_live=is_engine_live,
        limits=limits,
        ucx_net_devices=ucx_net_devices,
        on_reject=on_reject,
        wake=wake,
        allowed_networks=[ipaddress.ip_network(n) for n in sglang.allowed_networks],
    )


def serve_protocols(native: ServingBackend | None, sglang: NamedBackend | None) -> Transfer:
    """The backend for the protocols asked for: one of them, or both behind ``DualBackend``."""
    if native is not None and sglang is not None:
        dual = DualBackend(native, sglang)
        return Transfer(dual, dual.endpoints)
    if native is not None:
        return Transfer(native, {"bootstrap": native.bootstrap_endpoint})
    assert sglang is not None, "at least one protocol is served"
    return Transfer(sglang, sglang.endpoints)
