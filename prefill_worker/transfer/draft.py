"""A draft model's side of a push (``model.draft``): its pool and its first proposals, as a
protocol sends them beside the target's KV and aux row.

The draft's pool has the target's page geometry (same page bytes, same page count, its rows
at the target's slots), so a decode that holds a draft pool is addressed as one pool of the
target's layers followed by the draft's (``with_draft_layers``): page p of layer L is page p
of the draft's first layer. One descriptor list then covers both, and a chunk's pages go to
the target's and the draft's entries in one WRITE.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import PAGE_MAJOR, KVRegions


@dataclass(frozen=True, slots=True)
class DraftSide:
    """What a backend is given for a draft: its pool (``regions``: its aux fields name the
    draft rows' buffer) and its proposals, by aux row."""

    regions: KVRegions
    rows: DraftRows

    @property
    def num_layers(self) -> int:
        return self.regions.layout.num_layers


def with_draft_layers(target: KVRegions, draft: KVRegions) -> KVRegions:
    """One pool of ``target``'s layers, then ``draft``'s (the target's aux rows);
    ``ValueError`` when the two pools' pages differ, or for a page-major target (its layers
    are not separate regions)."""
    ours, theirs = target.layout, draft.layout
    if ours.kind == PAGE_MAJOR:
        raise ValueError("a draft's pool is sent beside a layer-major or mla pool only")
    same = (ours.kind, ours.page_bytes, ours.num_pages, target.device)
    if same != (theirs.kind, theirs.page_bytes, theirs.num_pages, draft.device):
        raise ValueError(
            f"the draft's pool ({theirs.kind}, {theirs.page_bytes}-byte pages x "
            f"{theirs.num_pages}) is not the target's ({ours.kind}, {ours.page_bytes}-byte "
            f"pages x {ours.num_pages})"
        )
    layout = dataclasses.replace(ours, num_layers=ours.num_layers + theirs.num_layers)
    return dataclasses.replace(
        target,
        layout=layout,
        k_base_addrs=target.k_base_addrs + draft.k_base_addrs,
        v_base_addrs=target.v_base_addrs + draft.v_base_addrs,
    )


def pool_into(target: KVRegions, draft: KVRegions | None, remote: KVRegions) -> KVRegions:
    """Our pool as a decode pool ``remote`` is written from: ``target``'s layers, then
    ``draft``'s when ``remote`` holds more layers than the target (a decode that holds a draft
    pool, which its desk admitted only for this draft), else ``target`` alone."""
    if draft is None or remote.layout.num_layers == target.layout.num_layers:
        return target
    return with_draft_layers(target, draft)
