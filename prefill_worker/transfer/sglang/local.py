"""This worker's side of SGLang transfers: its NIXL agent with the KV pool and the aux staging
rows registered, and the pool's descriptor list per layer (SGLang decodes keep per-layer
buffers, so a page-major pool is described per layer too); ``close`` releases them in
reverse. Imports NIXL."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.draft import DraftSide, with_draft_layers
from prefill_worker.transfer.nixl.agent import (
    deregister_regions,
    make_agent,
    region_tables,
    register_regions,
)
from prefill_worker.transfer.options import NixlOptions
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE, layer_view_table, mem_type
from prefill_worker.transfer.sglang.aux import AuxStaging, spec_row_dtype

log = logging.getLogger(__name__)


class LocalSide:
    """Opened in full or not at all (what was opened is closed when a step fails). With a
    draft: its pool registered too, the list of our pool with its layers after the target's
    (``draft_list``) and the speculating rows' staging (``spec_staging``)."""

    def __init__(
        self, regions: KVRegions, name: str, nixl: NixlOptions, draft: DraftSide | None = None
    ) -> None:
        self._closers: list[Callable[[], None]] = []
        self.draft_list: Any = None
        self.spec_staging: AuxStaging | None = None
        self.agent: Any = make_agent(
            name,
            list(nixl.backends),
            nixl.ucx_net_devices,
            capture_telemetry=nixl.capture_telemetry,
        )  # nixl_agent
        try:
            reg = register_regions(self.agent, regions)
            self._closers.append(lambda: deregister_regions(self.agent, reg))
            self.staging = AuxStaging(regions.num_aux_rows)
            table = np.array([[self.staging.base_addr, self.staging.num_bytes, 0]], np.uint64)
            staging_reg = self.agent.register_memory(table, AUX_MEM_TYPE)
            self._closers.append(lambda: self.agent.deregister_memory(staging_reg))
            self.kv_list: Any = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", layer_view_table(regions), mem_type(regions.device)
            )
            self._closers.append(self.kv_list.release)
            if draft is not None:
                self._open_draft(regions, draft)
        except BaseException:
            self.close()
            raise

    def _open_draft(self, regions: KVRegions, draft: DraftSide) -> None:
        kv, _ = region_tables(draft.regions)  # its rows are staged, never registered
        reg = self.agent.register_memory(kv, mem_type(draft.regions.device))
        self._closers.append(lambda: self.agent.deregister_memory(reg))
        row_dtype = spec_row_dtype(draft.rows.hidden_bytes)
        self.spec_staging = staging = AuxStaging(regions.num_aux_rows, row_dtype)
        table = np.array([[staging.base_addr, staging.num_bytes, 0]], np.uint64)
        staging_reg = self.agent.register_memory(table, AUX_MEM_TYPE)
        self._closers.append(lambda: self.agent.deregister_memory(staging_reg))
        both = with_draft_layers(regions, draft.regions)
        self.draft_list = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", layer_view_table(both), mem_type(regions.device)
        )
        self._closers.append(self.draft_list.release)

    def close(self) -> None:
        """Release in reverse; call it once no other thread uses the agent."""
        close_all(self._closers, "the local side")


def close_all(closers: list[Callable[[], None]], what: str) -> None:
    """Call ``closers`` last first, each once, logging (not raising) a failure, and empty the
    list: what the SGLang backend opened in order is released in reverse."""
    for close in reversed(closers):
        try:
            close()
        except Exception:
            log.exception("sglang: closing %s failed", what)
    closers.clear()
