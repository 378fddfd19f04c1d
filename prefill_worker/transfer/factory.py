"""Picks the transfer backends at start-up, for the daemon (the only caller that sees config):
the native bootstrap protocol (``make_backend``), SGLang's (``make_sglang_backend``), or both
(``serve_protocols``). No fake is selectable here: nothing in production config can pick one
(the scheduler's tests fake the seam in ``tests/unit/scheduler/fakes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.base import TransferBackend
from prefill_worker.transfer.dual import DualBackend
from prefill_worker.transfer.options import DEFAULT_HOOKS, Hooks, NativeOptions, SglangOptions


@dataclass(frozen=True, slots=True)
class Transfer:
    """The backend the engine drives, and what it bound (for ``/readyz`` and the ready file)."""

    backend: TransferBackend
    endpoints: Mapping[str, str]


def make_backend(
    regions: KVRegions, options: NativeOptions, hooks: Hooks = DEFAULT_HOOKS
) -> TransferBackend:
    """The native backend, its bootstrap server bound (``bootstrap_endpoint`` is the actual
    address, port 0 allowed). Raises ``OSError`` when the bootstrap address cannot be bound,
    and NIXL's own errors (or ``RuntimeError``) when no agent can be made."""
    from prefill_worker.transfer.native.backend import NixlBackend

    return NixlBackend(regions, options, hooks)


def make_sglang_backend(
    regions: KVRegions, options: SglangOptions, hooks: Hooks = DEFAULT_HOOKS
) -> TransferBackend:
    """This worker as an SGLang prefill (``transfer/sglang``): the bootstrap routes and the
    control socket bound, a NIXL agent of its own. ``hooks.wake`` is called from the control
    thread whenever a message arrives (the engine's inbox, when it sleeps elsewhere)."""
    from prefill_worker.transfer.sglang.backend import SglangBackend

    return SglangBackend(regions, options, hooks)


def serve_protocols(native: TransferBackend | None, sglang: TransferBackend | None) -> Transfer:
    """The backend for the protocols asked for: one of them, or both behind ``DualBackend``."""
    if native is not None and sglang is not None:
        dual = DualBackend(native, sglang)
        return Transfer(dual, dual.endpoints)
    backend = native or sglang
    assert backend is not None, "at least one protocol is served"
    return Transfer(backend, backend.endpoints)
