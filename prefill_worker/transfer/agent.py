"""The NIXL agent as both sides use it: created with the progress thread off, the KV regions
and aux rows registered once, and the tuple of NIXL's error types to catch.

Importing this module imports NIXL; keep it out of the core (``transfer.base`` never does).
"""

from __future__ import annotations

import os

# NIXL logs to stdout at INFO; quiet it unless the operator asked otherwise. Set before import.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np
from nixl_cu12 import _bindings as _nixl_bindings  # type: ignore[attr-defined]
from nixl_cu12._api import nixl_agent, nixl_agent_config

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.pagemap import device_id, mem_type

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


def make_agent(name: str, backends: list[str]) -> nixl_agent:
    """One agent; progress is driven by the owner's poll (check_xfer_state, get_new_notifs)."""
    config = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
    return nixl_agent(name, config)


def region_table(regions: KVRegions) -> np.ndarray:
    """[2L + 1, 3] (addr, len, dev): K regions, V regions, then the aux rows."""
    lay = regions.layout
    addrs = [*regions.k_base_addrs, *regions.v_base_addrs, regions.aux_base_addr]
    lens = [lay.region_bytes] * (2 * lay.num_layers) + [regions.num_aux_rows * AUX_ROW_BYTES]
    dev = device_id(regions.device)
    return np.array([[a, n, dev] for a, n in zip(addrs, lens, strict=True)], dtype=np.uint64)


def register_regions(agent: nixl_agent, regions: KVRegions) -> object:
    """Register the KV pool and aux rows once; returns the descriptors for deregistration."""
    return agent.register_memory(region_table(regions), mem_type(regions.device))
