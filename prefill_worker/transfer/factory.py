"""Picks the transfer backends at start-up, for the daemon (the only caller that sees config):
the native bootstrap protocol (``make_backend``), SGLang's (``make_sglang_backend``), vLLM's
pulls (``make_vllm_backend``), or several (``serve_protocols``). No fake is selectable here:
nothing in production config can pick one (the scheduler's tests fake the seam in
``tests/unit/scheduler/fakes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefill_worker.kv.layout import KVRegions
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer.base import TransferBackend
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.dual import DualBackend
from prefill_worker.transfer.options import (
    DEFAULT_HOOKS,
    Hooks,
    NativeOptions,
    SglangOptions,
    VllmOptions,
)
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.vllm.tickets import Tickets

if TYPE_CHECKING:
    from prefill_worker.transfer.vllm.backend import VllmBackend
    from prefill_worker.transfer.vllm.shared import GroupStaging


@dataclass(frozen=True, slots=True)
class Transfer:
    """The backend the engine drives, and what it bound (for ``/readyz`` and the ready file);
    ``tickets`` when vLLM decodes are served (the HTTP front opens them), and then
    ``mirror_layers``: the staging region the forward writes (``VllmBackend.mirror_layers``)."""

    backend: TransferBackend
    endpoints: Mapping[str, str]
    tickets: Tickets | None = None
    mirror_layers: tuple[np.ndarray, ...] = ()


def make_backend(
    regions: KVRegions,
    options: NativeOptions,
    hooks: Hooks = DEFAULT_HOOKS,
    state: StateRegions | None = None,
    draft: DraftSide | None = None,
    sliding: SlidingLayers | None = None,
) -> TransferBackend:
    """The native backend, its bootstrap server bound (``bootstrap_endpoint`` is the actual
    address, port 0 allowed); with ``state`` (a hybrid model's state pool) it sends each
    request's state slot too, with ``draft`` (a draft model's pool and rows) the draft's
    pages and row to decodes that registered a draft pool, with ``sliding`` of a windowed
    sliding pool (``pool_pages``) each sliding layer's window from its own pages. Raises
    ``OSError`` when the bootstrap address cannot be bound, and NIXL's own errors (or
    ``RuntimeError``) when no agent can be made."""
    from prefill_worker.transfer.native.backend import NixlBackend

    return NixlBackend(regions, options, hooks, state, draft, sliding)


def make_sglang_backend(
    regions: KVRegions,
    options: SglangOptions,
    hooks: Hooks = DEFAULT_HOOKS,
    draft: DraftSide | None = None,
    dsa: StateRegions | None = None,
) -> TransferBackend:
    """This worker as an SGLang prefill (``transfer/sglang``): the bootstrap routes and the
    control socket bound, a NIXL agent of its own. ``hooks.wake`` is called from the control
    thread whenever a message arrives (the engine's inbox, when it sleeps elsewhere).
    ``draft``: a draft model's pool and rows, for decodes that speculate. ``dsa``: a DSA
    model's index keys in SGLang's FP8 pages (``model.index_fp8``), sent with each page."""
    from prefill_worker.transfer.sglang.backend import SglangBackend

    return SglangBackend(regions, options, hooks, draft, dsa)


def make_vllm_backend(
    regions: KVRegions,
    options: VllmOptions,
    tickets: Tickets,
    hooks: Hooks = DEFAULT_HOOKS,
    group: GroupStaging | None = None,
    pins: PagePins | None = None,
) -> VllmBackend:
    """This worker as a vLLM prefill (``transfer/vllm``): the staging region registered with
    a NIXL agent of its own (a ``vllm_blocks`` pool itself, with ``pins``: ``vllm.direct``),
    a side channel bound per vLLM version served. ``StagingRefused``
    (a ``ValueError``) for a pool it cannot stage (MLA, device memory)."""
    from prefill_worker.transfer.vllm.backend import VllmBackend
    from prefill_worker.transfer.vllm.channel import serve_side_channels

    return VllmBackend(regions, options, tickets, serve_side_channels, hooks, group, pins)


def serve_protocols(
    backends: Mapping[str, TransferBackend],
    tickets: Tickets | None = None,
    mirror_layers: tuple[np.ndarray, ...] = (),
) -> Transfer:
    """The backend for the protocols asked for, by name in serving order: one of them, or
    all behind ``DualBackend`` (the first one's ``wait`` is where the engine sleeps)."""
    assert backends, "at least one protocol is served"
    if len(backends) == 1:
        (backend,) = backends.values()
        return Transfer(backend, backend.endpoints, tickets, mirror_layers)
    dual = DualBackend(backends)
    return Transfer(dual, dual.endpoints, tickets, mirror_layers)
