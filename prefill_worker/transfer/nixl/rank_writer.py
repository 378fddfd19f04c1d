"""One prefill rank's KV writes into decode ranks, head slice by head slice: the rank-level
seam of a tensor-parallel (TP) group's transfer. Each rank owns its own NIXL agent and its own
pool, which holds its heads only (``kv.heads``); it writes, into each decode rank, the slice
``transfer.headplan`` gives it (nothing into a decode rank it does not feed)::

    rank r's pool ─▶ RankWriter(agent, RankPlace(r, p, KV), regions)
                       add_peer(metadata, regions, dst_rank j, dst_tp d)
                         ─▶ plan_rank(KV, r, p, d)'s slice for j, or None (not fed by r)
                       post(name, src_pages, dst_pages) ─▶ one NIXL WRITE of that slice

A decode rank with a hybrid SWA pool (SGLang's, ``transfer/sglang/swa.py``) is two pools
(``WindowPool``): its KV list takes our full layers' pages, its SWA pool our sliding layers'
window pages (``post(..., window=True)``), the same head slice of each.

Which rank sends the aux row and the status, and when (after every rank's writes landed), is
the group's business, not this class's: it moves KV bytes and reports each write's state.
``prep_slice_lists``/``prep_local_slice`` prepare the same token-run lists for the push
engine (a TP-1 worker feeding a decode of TP > 1). Importing it imports NIXL (``nixl.agent``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout, KVRegions
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
class WindowPool:
    """A decode rank's hybrid SWA pool: ``regions``, its pages of our ``sliding`` layers
    (``swa_window.swa_pool_regions``); its KV list then holds our other layers."""

    sliding: tuple[int, ...]
    regions: KVRegions


@dataclass(frozen=True, slots=True)
class _Part:
    ours: KVLayout  # our layout of the layers this part writes
    theirs: KVLayout
    local: Any  # this rank's prepared list for the slice's source side
    remote: Any  # the decode rank's prepared list
    descriptor_bytes: int  # what one descriptor of either list covers


@dataclass(frozen=True, slots=True)
class _Peer:
    head_slice: HeadSlice
    kv: _Part
    window: _Part | None  # a hybrid SWA pool's (``WindowPool``)


class RankWriter:
    """Writes this rank's head slices; owns the prepared lists, not the agent."""

    def __init__(self, agent: Any, place: RankPlace, regions: KVRegions) -> None:
        if regions.layout.num_kv_heads != len(place.heads):
            raise ValueError(
                f"rank {place.rank} of {place.tp_size} holds {len(place.heads)} of "
                f"{place.num_kv_heads} KV heads; its pool has {regions.layout.num_kv_heads}"
            )
        self._agent, self.place, self._regions = agent, place, regions
        self._local: dict[tuple[int, int, bool, tuple[int, ...]], Any] = {}  # (.., layers)
        self._peers: dict[str, _Peer] = {}

    def slice_for(self, dst_rank: int, dst_tp: int) -> HeadSlice | None:
        """What this rank writes into decode rank ``dst_rank`` of ``dst_tp``, if anything."""
        place = self.place
        slices = plan_rank(place.num_kv_heads, place.rank, place.tp_size, dst_tp)
        return next((s for s in slices if s.dst_rank == dst_rank), None)

    def add_peer(
        self,
        metadata: bytes,
        regions: KVRegions,
        dst_rank: int,
        dst_tp: int,
        window: WindowPool | None = None,
    ) -> str | None:
        """Add decode rank ``dst_rank`` (its NIXL metadata and pool, with its hybrid SWA pool
        when it has one): its agent name, or None when this rank writes nothing into it.
        ``ValueError`` when its pool does not fit."""
        head_slice = self.slice_for(dst_rank, dst_tp)
        if head_slice is None:
            return None
        every = tuple(range(self._regions.layout.num_layers))
        full = every if window is None else tuple(i for i in every if i not in window.sliding)
        pairs = [(full, regions)] + ([] if window is None else [(window.sliding, window.regions)])
        for layers, theirs in pairs:
            why = slice_layout_error(
                _layers_of(self._regions, layers).layout, theirs.layout, head_slice
            )
            if why is not None:
                raise ValueError(why)
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        kv, *rest = [self._part(name, head_slice, layers, theirs) for layers, theirs in pairs]
        self._peers[name] = _Peer(head_slice, kv, rest[0] if rest else None)
        return name

    def _part(self, name: str, s: HeadSlice, layers: tuple[int, ...], theirs: KVRegions) -> _Part:
        table = write_table(theirs, s.dst_head_offset, s.num_heads, s.is_whole_page)
        remote = self._agent.prep_xfer_dlist(name, table, mem_type(theirs.device))
        ours = _layers_of(self._regions, layers)
        key = (s.src_head_offset, s.num_heads, s.is_whole_page, layers)
        if key not in self._local:
            local_table = write_table(ours, *key[:3])
            device = mem_type(ours.device)
            self._local[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_table, device)
        return _Part(ours.layout, theirs.layout, self._local[key], remote, int(table[0][1]))

    def post(
        self,
        name: str,
        src_pages: np.ndarray,
        dst_pages: np.ndarray,
        notif: bytes,
        window: bool = False,
    ) -> tuple[Any, int]:
        """Start one WRITE of this rank's slice of ``src_pages`` into the decode rank's
        ``dst_pages`` (``window``: our sliding layers' pages into its hybrid SWA pool's): the
        handle (``agent.check_xfer_state`` says when it landed) and the bytes its descriptors
        cover. ``ValueError`` for a window into a decode rank without that pool."""
        part = self._part_of(name, window)
        is_whole = self._peers[name].head_slice.is_whole_page
        local_idx = write_indices(src_pages, part.ours, is_whole)
        remote_idx = write_indices(dst_pages, part.theirs, is_whole)
        return self.post_indices(name, local_idx, remote_idx, notif, window)

    def post_indices(
        self,
        name: str,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        notif: bytes,
        window: bool = False,
    ) -> tuple[Any, int]:
        """``post`` of descriptor indices given (a route's: ``push.window_route``, whose
        ``runs`` are 1 for a whole-page slice, else ``page_size``)."""
        part = self._part_of(name, window)
        handle = self._agent.make_prepped_xfer(
            "WRITE", part.local, local_idx, part.remote, remote_idx, notif
        )
        state = self._agent.transfer(handle)
        if state == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL refused a write to {name}")
        return handle, len(local_idx) * part.descriptor_bytes

    def _part_of(self, name: str, window: bool) -> _Part:
        peer = self._peers[name]
        part = peer.window if window else peer.kv
        if part is None:
            raise ValueError(f"decode agent {name} registered no hybrid SWA pool")
        return part

    def close(self) -> None:
        """Release every prepared list and forget the decode agents (errors logged: the peer
        is gone either way)."""
        for name, peer in self._peers.items():
            for part in (peer.kv, peer.window):
                if part is not None:
                    part.remote.release()
            try:
                self._agent.remove_remote_agent(name)
            except NIXL_ERRORS as exc:
                log.warning("removing agent %s: %s", name, exc)
        for local in self._local.values():
            local.release()
        self._peers.clear()
        self._local.clear()


def _layers_of(regions: KVRegions, layers: tuple[int, ...]) -> KVRegions:
    """``regions`` of ``layers`` alone (all of them: ``regions`` itself); a layer-major pool
    (one base per layer plane) only."""
    if layers == tuple(range(regions.layout.num_layers)):
        return regions
    if regions.layout.kind != LAYER_MAJOR or regions.layer_pages:
        raise ValueError(f"a {regions.layout.kind} pool cannot be written by layer subsets")
    layout = dataclasses.replace(regions.layout, num_layers=len(layers), kv_scales=())
    k = tuple(regions.k_base_addrs[i] for i in layers)
    v = tuple(regions.v_base_addrs[i] for i in layers)
    return KVRegions(layout, k, v, regions.device, regions.aux_base_addr, regions.num_aux_rows)


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
