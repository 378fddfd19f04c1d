"""A draft model on the native protocol (``transfer.draft``): the worker's draft pool and
rows registered beside its target pool, the list of its pool with the draft's layers after
the target's (``LocalDraft``), and the pool a registering decode is written into
(``decode_draft``): with the draft's layers when it registered a draft pool of this worker's
draft (``wire.DraftPool``), the target's alone when it registered none or the worker has
no draft. Its rows go with the aux row (``NativeDialect``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from msgspec import UNSET

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.draft import DraftSide, with_draft_layers
from prefill_worker.transfer.nixl.agent import region_tables
from prefill_worker.transfer.nixl.state_lists import LOCAL_AGENT
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE, layer_view_table, mem_type
from prefill_worker.transfer.push.dialect import PageLists
from prefill_worker.transfer.validate import Refusal, RejectReason


class LocalDraft:
    """Registered and prepared in full or not at all; ``close`` once no thread uses the
    agent."""

    def __init__(self, agent: Any, target: KVRegions, draft: DraftSide) -> None:
        self.draft, self._agent = draft, agent
        both = with_draft_layers(target, draft.regions)  # ValueError before NIXL sees it
        kv, _ = region_tables(draft.regions)
        self._kv_reg = agent.register_memory(kv, mem_type(draft.regions.device))
        self._rows_reg = self.list = None
        try:
            rows = draft.rows
            table = np.array([[rows.base_addr, rows.num_rows * rows.row_bytes, 0]], np.uint64)
            self._rows_reg = agent.register_memory(table, AUX_MEM_TYPE)
            view = layer_view_table(both)
            self.list = agent.prep_xfer_dlist(LOCAL_AGENT, view, mem_type(target.device))
        except BaseException:
            self.close()
            raise
        self.num_regions = len(view)

    def page_lists(self, pages: PageLists) -> PageLists:
        """``pages`` (our target's) with the draft's layers."""
        return PageLists(self.list, self.num_regions, pages.region_bytes, pages.head_bytes)

    def close(self) -> None:
        if self.list is not None:
            self.list.release()
        if self._rows_reg is not None:
            self._agent.deregister_memory(self._rows_reg)
        self._agent.deregister_memory(self._kv_reg)


def decode_draft(msg: wire.Register, ours: DraftSide | None) -> KVRegions | Refusal:
    """The decode's pool as this worker writes it: with its draft's layers when both have a
    draft, else its target pool; a refusal when its draft is not this worker's draft."""
    target = msg.regions
    if ours is None or msg.draft is UNSET:
        return target
    theirs = msg.draft
    num_layers, row_bytes = len(theirs.k_base_addrs), theirs.row_bytes
    if (num_layers, row_bytes) != (ours.num_layers, ours.rows.row_bytes):
        why = (
            f"draft mismatch: the decode's draft pool has {num_layers} layers and rows of "
            f"{row_bytes} bytes; this worker's draft has {ours.num_layers} layers and rows of "
            f"{ours.rows.row_bytes} bytes"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    return with_draft_layers(target, theirs.regions(target))
