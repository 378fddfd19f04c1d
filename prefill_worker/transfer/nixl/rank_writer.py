"""One prefill rank's KV writes into decode ranks, head slice by head slice: the rank-level
seam of a tensor-parallel (TP) group's transfer. Each rank owns its own NIXL agent and its own
pool, which holds its heads only (``kv.heads``); it writes, into each decode rank, the slice
``transfer.headplan`` gives it (nothing into a decode rank it does not feed)::

    rank r's pool ─▶ RankWriter(agent, RankPlace(r, p, KV), regions)
                       add_peer(metadata, regions, dst_rank j, dst_tp d)
                         ─▶ plan_rank(KV, r, p, d)'s slice for j, or None (not fed by r)
                       post(name, src_pages, dst_pages) ─▶ one NIXL WRITE of that slice

Which rank sends the aux row and the status, and when (after every rank's writes landed), is
the group's business, not this class's: it moves KV bytes and reports each write's state.
``prep_slice_lists``/``prep_local_slice`` prepare the same token-run lists for the push
engine (a TP-1 worker feeding a decode of TP > 1). Importing it imports NIXL (``nixl.agent``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer.headplan import (
    HeadSlice,
    plan_rank,
    slice_layout_error,
    slice_table,
    write_indices,
    write_table,
)
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, PreppedLists, mem_type, prep_lists

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankPlace:
    """A prefill rank's place in its TP group, and so the KV heads its pool holds."""

    rank: int
    tp_size: int
    num_kv_heads: int

    @property
    def heads(self) -> range:
        return kv_head_range(self.num_kv_heads, self.rank, self.tp_size)


@dataclass(frozen=True, slots=True)
class _Peer:
    head_slice: HeadSlice
    regions: KVRegions
    local: Any  # this rank's prepared list for the slice's source side
    remote: Any  # the decode rank's prepared list
    descriptor_bytes: int  # what one descriptor of either list covers


class RankWriter:
    """Writes this rank's head slices; owns the prepared lists, not the agent."""

    def __init__(self, agent: Any, place: RankPlace, regions: KVRegions) -> None:
        if regions.layout.num_kv_heads != len(place.heads):
            raise ValueError(
                f"rank {place.rank} of {place.tp_size} holds {len(place.heads)} of "
                f"{place.num_kv_heads} KV heads; its pool has {regions.layout.num_kv_heads}"
            )
        self._agent, self.place, self._regions = agent, place, regions
        self._local: dict[tuple[int, int, bool], Any] = {}  # by (offset, heads, whole)
        self._peers: dict[str, _Peer] = {}

    def slice_for(self, dst_rank: int, dst_tp: int) -> HeadSlice | None:
        """What this rank writes into decode rank ``dst_rank`` of ``dst_tp``, if anything."""
        place = self.place
        slices = plan_rank(place.num_kv_heads, place.rank, place.tp_size, dst_tp)
        return next((s for s in slices if s.dst_rank == dst_rank), None)

    def add_peer(
        self, metadata: bytes, regions: KVRegions, dst_rank: int, dst_tp: int
    ) -> str | None:
        """Add decode rank ``dst_rank`` (its NIXL metadata and pool): its agent name, or None
        when this rank writes nothing into it. ``ValueError`` when its pool does not fit."""
        head_slice = self.slice_for(dst_rank, dst_tp)
        if head_slice is None:
            return None
        why = slice_layout_error(self._regions.layout, regions.layout, head_slice)
        if why is not None:
            raise ValueError(why)
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        table = write_table(
            regions, head_slice.dst_head_offset, head_slice.num_heads, head_slice.is_whole_page
        )
        remote = self._agent.prep_xfer_dlist(name, table, mem_type(regions.device))
        local = self._local_list(head_slice)
        self._peers[name] = _Peer(head_slice, regions, local, remote, int(table[0][1]))
        return name

    def _local_list(self, s: HeadSlice) -> Any:
        key = (s.src_head_offset, s.num_heads, s.is_whole_page)
        if key not in self._local:
            table = write_table(self._regions, *key)
            device = mem_type(self._regions.device)
            self._local[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, device)
        return self._local[key]

    def post(
        self, name: str, src_pages: np.ndarray, dst_pages: np.ndarray, notif: bytes
    ) -> tuple[Any, int]:
        """Start one WRITE of this rank's slice of ``src_pages`` into the decode rank's
        ``dst_pages``: the handle (``agent.check_xfer_state`` says when it landed) and the
        bytes its descriptors cover."""
        peer = self._peers[name]
        is_whole = peer.head_slice.is_whole_page
        local_idx = write_indices(src_pages, self._regions.layout, is_whole)
        remote_idx = write_indices(dst_pages, peer.regions.layout, is_whole)
        return self.post_indices(name, local_idx, remote_idx, notif)

    def post_indices(
        self, name: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes
    ) -> tuple[Any, int]:
        """``post`` of descriptor indices given (a route's: ``push.window_route``, whose
        ``runs`` are 1 for a whole-page slice, else ``page_size``)."""
        peer = self._peers[name]
        handle = self._agent.make_prepped_xfer(
            "WRITE", peer.local, local_idx, peer.remote, remote_idx, notif
        )
        state = self._agent.transfer(handle)
        if state == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL refused a write to {name}")
        return handle, len(local_idx) * peer.descriptor_bytes

    def close(self) -> None:
        """Release every prepared list and forget the decode agents (errors logged: the peer
        is gone either way)."""
        for name, peer in self._peers.items():
            peer.remote.release()
            try:
                self._agent.remove_remote_agent(name)
            except NIXL_ERRORS as exc:
                log.warning("removing agent %s: %s", name, exc)
        for local in self._local.values():
            local.release()
        self._peers.clear()
        self._local.clear()


def prep_slice_lists(
    agent: Any, agent_name: str, regions: KVRegions, head_offset: int, num_heads: int
) -> PreppedLists:
    """A decode rank's lists when it holds a sub-range of our heads: token runs of its pool
    of heads [head_offset, + num_heads) of each token (``headplan.slice_table``), and its aux
    rows as usual (``pagemap.aux_descriptor_table``)."""
    return prep_lists(agent, agent_name, regions, slice_table(regions, head_offset, num_heads))


def prep_local_slice(agent: Any, regions: KVRegions, head_offset: int, num_heads: int) -> Any:
    """Our pool's token runs of heads [head_offset, + num_heads): one prepared list."""
    table = slice_table(regions, head_offset, num_heads)
    return agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem_type(regions.device))
