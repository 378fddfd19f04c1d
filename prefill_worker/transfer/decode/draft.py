"""A speculating decode's draft (``transfer.draft.DraftSide``: its pool, the target pool's
page geometry and device, and its rows, one per aux row) as the decode SDK registers it with
its agent and names it in ``register`` (``wire.DraftPool``): the worker writes the draft's
pages with the target's and each room's draft row with its aux row."""

from __future__ import annotations

from typing import Any

import numpy as np

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.nixl.agent import region_tables
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE, mem_type


def check_draft(draft: DraftSide, target: KVRegions) -> None:
    """``ValueError`` unless the draft's pool has the target pool's pages and device and a
    row per aux row."""
    ours, theirs = target.layout, draft.regions.layout
    if (theirs.kind, theirs.page_bytes, theirs.num_pages) != (
        ours.kind,
        ours.page_bytes,
        ours.num_pages,
    ) or draft.regions.device != target.device:
        raise ValueError("the draft pool's pages or device are not the KV pool's")
    if draft.rows.num_rows != target.num_aux_rows:
        raise ValueError(
            f"{draft.rows.num_rows} draft rows for {target.num_aux_rows} aux rows: one each"
        )


def register_draft(agent: Any, draft: DraftSide) -> list[Any]:
    """Its pool (as the KV pool's memory kind) and its rows (host memory); the
    registrations, for ``agent.deregister_memory``."""
    kv, _ = region_tables(draft.regions)
    regs = [agent.register_memory(kv, mem_type(draft.regions.device))]
    rows = draft.rows
    table = np.array([[rows.base_addr, rows.num_rows * rows.row_bytes, 0]], np.uint64)
    try:
        regs.append(agent.register_memory(table, AUX_MEM_TYPE))
    except BaseException:
        agent.deregister_memory(regs[0])
        raise
    return regs


def draft_pool(draft: DraftSide) -> wire.DraftPool:
    return wire.DraftPool(
        k_base_addrs=draft.regions.k_base_addrs,
        v_base_addrs=draft.regions.v_base_addrs,
        rows_base_addr=draft.rows.base_addr,
        row_bytes=draft.rows.row_bytes,
    )
