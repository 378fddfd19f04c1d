"""A state component's pool (``kv.state_layout.StateRegions``) as NIXL sees it: registered
once per (tensor, layer) run, and prepared as a strided list whose descriptor
``run * num_items + item`` is one item of one run (``StateRegions.item_indices``). Both sides
use it: the worker for its own slots, the decode SDK for its own, and the worker again for
each decode's (the remote list a slot is written into).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefill_worker.kv.state_layout import StateComponent, StateRegions
from prefill_worker.transfer.pagemap import device_id, mem_type

LOCAL_AGENT = "NIXL_INIT_AGENT"


def state_table(regions: StateRegions) -> np.ndarray:
    """[runs, 5] strided rows (addr, len, dev, stride, count): ``num_items`` items per run."""
    dev, num_items = device_id(regions.device), regions.component.num_items
    rows = [[addr, size, dev, size, num_items] for addr, size in regions.runs]
    return np.array(rows, dtype=np.uint64).reshape(len(rows), 5)


def register_state(agent: Any, regions: StateRegions) -> Any:
    """Register every run of the pool (DRAM or VRAM, as its device); the registration."""
    dev, num_items = device_id(regions.device), regions.component.num_items
    rows = [[addr, size * num_items, dev] for addr, size in regions.runs]
    table = np.array(rows, dtype=np.uint64).reshape(len(rows), 3)
    return agent.register_memory(table, mem_type(regions.device))


def prep_state_list(agent: Any, agent_name: str, regions: StateRegions) -> Any:
    """The pool's prepared list; ``agent_name`` ``LOCAL_AGENT`` for our own."""
    return agent.prep_xfer_dlist(agent_name, state_table(regions), mem_type(regions.device))


def prep_share(agent: Any, regions: StateRegions, share: StateComponent, rank: int) -> StateLists:
    """Our pool's share ``rank`` of every item, for a decode rank that holds ``share`` of each
    (its tensors' items a fraction of ours, shares rank after rank within an item): a list of
    one strided row per run, each share an item apart, so descriptor ``run * num_items +
    item`` is that item's share (``StateLists.indices``, as for whole items)."""
    dev, num_items = device_id(regions.device), regions.component.num_items
    sizes = [t.item_bytes for t in share.tensors for _ in share.layer_ids]
    rows = [
        [addr + rank * size, size, dev, stride, num_items]
        for (addr, stride), size in zip(regions.runs, sizes, strict=True)
    ]
    table = np.array(rows, dtype=np.uint64).reshape(len(rows), 5)
    prepped = agent.prep_xfer_dlist(LOCAL_AGENT, table, mem_type(regions.device))
    num_layers = len(share.layer_ids)
    bases = tuple(
        tuple(row[0] for row in rows[t * num_layers : (t + 1) * num_layers])
        for t in range(len(share.tensors))
    )
    component = dataclasses.replace(share, num_items=num_items)
    return StateLists(StateRegions(component, bases, regions.device), prepped)


@dataclass(frozen=True, slots=True)
class StateLists:
    """One side's state pool and its prepared list (the worker's own, or a decode's)."""

    regions: StateRegions
    prepped: Any  # nixl prepped descriptor list

    def page_indices(self, pages: np.ndarray) -> np.ndarray:
        """The descriptors of ``pages`` (a paged component: items are pages) in every run,
        run after run: ``run * num_items + page``."""
        runs = np.arange(len(self.regions.runs), dtype=np.int64)[:, None]
        flat = runs * self.regions.component.num_items + np.asarray(pages, dtype=np.int64)
        return flat.ravel().astype(np.int32)

    def indices(self, item: int) -> np.ndarray:
        """The descriptors of one slot, whole: one per (tensor, layer) run."""
        return np.asarray(self.regions.item_indices(item), dtype=np.int32)
