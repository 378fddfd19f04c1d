"""The NIXL agent as both sides use it: created with the progress thread off, the KV regions
and aux rows registered once, and the tuple of NIXL's error types to catch.

Importing this module imports NIXL; keep it out of the core (``transfer.base`` never does).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

# NIXL logs to stdout at INFO; quiet it unless the operator asked otherwise. Set before import.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np

try:  # the CUDA 12 build, as pinned; a CUDA 13 host (the GPU check) carries nixl-cu13
    from nixl_cu12 import _bindings as _nixl_bindings  # type: ignore[attr-defined]
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover - only where nixl-cu13 is what is installed
    from nixl_cu13 import _bindings as _nixl_bindings  # type: ignore[no-redef]
    from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.nixl.listeners import note_new_listeners
from prefill_worker.transfer.pagemap import (
    AUX_MEM_TYPE,
    aux_descriptor_table,
    device_id,
    kv_descriptor_table,
    mem_type,
)

log = logging.getLogger(__name__)

NIXL_ERRORS: tuple[type[Exception], ...] = (
    _nixl_bindings.nixlBackendError,
    _nixl_bindings.nixlCancelledError,
    _nixl_bindings.nixlInvalidParamError,
    _nixl_bindings.nixlMismatchError,
    _nixl_bindings.nixlNotAllowedError,
    _nixl_bindings.nixlNotFoundError,
    _nixl_bindings.nixlNotPostedError,
    _nixl_bindings.nixlNotSupportedError,
    _nixl_bindings.nixlRemoteDisconnectError,
    _nixl_bindings.nixlRepostActiveError,
    _nixl_bindings.nixlUnknownError,
)


def make_agent(
    name: str,
    backends: list[str],
    ucx_net_devices: str | None = None,
    progress_thread: bool = False,
    capture_telemetry: bool = False,
) -> nixl_agent:
    """One agent; progress is driven by the owner's poll (check_xfer_state, get_new_notifs),
    or with ``progress_thread`` by NIXL's own thread too (an agent others READ from: over
    TCP, UCX serves a remote READ only while this side progresses).

    ``ucx_net_devices`` (UCX_NET_DEVICES, e.g. ``lo`` or ``eth0``) picks the interfaces UCX
    opens its TCP listeners on; UCX reads it when the backend is created, here and only here.
    NIXL's own listener (``enable_listen_thread``) stays off: metadata goes over bootstrap.
    ``capture_telemetry``: NIXL measures each transfer (``poster.read_telemetry``)."""
    config = nixl_agent_config(
        enable_prog_thread=progress_thread,
        enable_listen_thread=False,
        backends=list(backends),
        capture_telemetry=capture_telemetry,
    )
    with note_new_listeners():  # UCX's TCP listeners: their silent connections are closed
        if not ucx_net_devices:
            return nixl_agent(name, config)
        previous = os.environ.get("UCX_NET_DEVICES")
        os.environ["UCX_NET_DEVICES"] = ucx_net_devices  # for this agent only: restored below
        try:
            return nixl_agent(name, config)
        finally:
            if previous is None:
                del os.environ["UCX_NET_DEVICES"]
            else:
                os.environ["UCX_NET_DEVICES"] = previous


@dataclass(frozen=True, slots=True)
class Registration:
    """The two registrations of one pool: KV in its own memory type, aux rows as DRAM."""

    kv: Any
    aux: Any


@dataclass(frozen=True, slots=True)
class PreppedLists:
    """One side's prepared descriptor lists (``pagemap``): the KV pool, and the aux rows."""

    kv: Any
    aux: Any

    def release(self) -> None:
        self.kv.release()
        self.aux.release()


def region_tables(regions: KVRegions) -> tuple[np.ndarray, np.ndarray]:
    """([num_regions, 3] KV regions, [1, 3] aux rows) as (addr, len, dev): what is
    registered (2L regions layer-major, the one pool page-major)."""
    lay = regions.layout
    addrs = regions.region_base_addrs
    dev = device_id(regions.device)
    counts = regions.region_num_pages  # a windowed sliding pool's sliding layers: their own
    sizes = [lay.region_bytes if n == lay.num_pages else n * lay.page_bytes for n in counts]
    kv = np.array([[a, size, dev] for a, size in zip(addrs, sizes, strict=True)], np.uint64)
    aux_bytes = regions.num_aux_rows * AUX_ROW_BYTES
    aux = np.array([[regions.aux_base_addr, aux_bytes, 0]], dtype=np.uint64)
    return kv, aux


def register_regions(agent: nixl_agent, regions: KVRegions) -> Registration:
    """Register the KV pool (DRAM or VRAM) and the aux rows (host DRAM) once."""
    kv, aux = region_tables(regions)
    kv_reg = agent.register_memory(kv, mem_type(regions.device))
    try:
        return Registration(kv_reg, agent.register_memory(aux, AUX_MEM_TYPE))
    except BaseException:
        agent.deregister_memory(kv_reg)
        raise


def deregister_regions(agent: nixl_agent, registration: Registration) -> None:
    agent.deregister_memory(registration.aux)
    agent.deregister_memory(registration.kv)


def prep_lists(
    agent: nixl_agent, agent_name: str, regions: KVRegions, kv_table: Any = None
) -> PreppedLists:
    """Prepare one side's descriptor lists; ``agent_name`` is "NIXL_INIT_AGENT" for ours.
    ``kv_table``: the KV rows to list instead of the whole pages (a decode rank's head slice,
    ``headplan.slice_table``); the aux rows are listed either way."""
    table = kv_descriptor_table(regions) if kv_table is None else kv_table
    kv = agent.prep_xfer_dlist(agent_name, table, mem_type(regions.device))
    try:
        aux = agent.prep_xfer_dlist(agent_name, aux_descriptor_table(regions), AUX_MEM_TYPE)
    except BaseException:
        kv.release()
        raise
    return PreppedLists(kv, aux)


def forget_agent(agent: nixl_agent, name: str, lists: PreppedLists, *others: Any) -> None:
    """Release a decode peer's prepared lists (``others``: more of its prepared lists, say its
    state pool's) and remove its agent (errors logged: the peer is gone either way)."""
    lists.release()
    for other in others:
        other.release()
    try:
        agent.remove_remote_agent(name)
    except NIXL_ERRORS as exc:
        log.warning("removing agent %s: %s", name, exc)
