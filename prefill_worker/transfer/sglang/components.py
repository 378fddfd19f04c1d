"""A hybrid model's state component on SGLang's protocol: which one this worker's model has
and what it asks of the desk. A model has at most one kind (SGLang 0.5.23's
``setup_state_kv_args`` registers one component per decode):

    kind    model                          a decode registers          a request names
    swa     gpt-oss, Gemma 3 (sliding)     a hybrid SWA pool           its window pages
    dsa     DeepSeek-V3.2, GLM-5           its FP8 index pool          index pages = its KV pages
    mamba   Qwen3.5, Qwen3-Next (linear)   a mamba pool                one slot

Each kind's checks live in its own module (``sglang.swa``, ``sglang.dsa``, ``sglang.mamba``);
this one dispatches to them, so that the desk handles any decode the same way: a registration
accepted here is then checked and mapped as a plain KV pool, and a request's state indices
become the want's state part (``has_state`` then off: nothing else reads them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.nixl.state_lists import StateLists, prep_share
from prefill_worker.transfer.sglang.dialect import SglangPeer
from prefill_worker.transfer.sglang.dsa import accept_index_pool, index_want
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest
from prefill_worker.transfer.sglang.mamba import accept_mamba, mamba_want
from prefill_worker.transfer.sglang.swa import (
    WindowRoute,
    accept_window,
    window_route,
    window_want,
    windowed_full_pool,
    windowed_slices,
)
from prefill_worker.transfer.slot_stage import StagedState
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import BootstrapLimits, Refusal, RejectReason


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """A registration as its KV list alone (checked and mapped as any decode's), the layout
    that list has, its state pool (None: none), and the share of our staged state slots a
    mamba decode rank of attention TP > 1 takes (None: whole slots)."""

    registration: Registration
    layout: KVLayout
    state: StateRegions | None = None
    share: StateLists | None = None


class StateComponents:
    """The model's state component, if any, for SGLang decodes."""

    def __init__(
        self,
        agent: Any,  # nixl_agent
        limits: BootstrapLimits,
        run_on_agent: Callable[..., Any] = lambda fn, *args: fn(*args),
        sliding: SlidingLayers | None = None,  # a model whose decodes may hold a hybrid SWA pool
        dsa: StateRegions | None = None,  # a DSA model's FP8 index pages (``sglang.dsa``)
        mamba: StagedState | None = None,  # a hybrid model, whose decodes hold a mamba pool
    ) -> None:
        assert (sliding, dsa, mamba).count(None) >= 2, "a model has one state component kind"
        self._agent, self._limits, self._run = agent, limits, run_on_agent
        self._sliding, self._dsa, self._mamba = sliding, dsa, mamba
        self._shares: dict[tuple[int, int], StateLists] = {}  # (rank, TP size): ``_share``

    def accept(self, reg: Registration, ours: KVLayout) -> Accepted | Refusal:
        """The decode's registration with its state pool split off, or why it is refused; a
        registration without state (or of a model without any) as it came."""
        if reg.has_state and self._sliding is not None:  # a hybrid SWA pool (``sglang.swa``)
            window = accept_window(reg, ours, self._sliding, self._limits)
            if isinstance(window, Refusal):
                return window
            return Accepted(window.registration, window.layout, window.swa)
        if self._sliding is not None and self._sliding.pool_pages:
            return Refusal(RejectReason.UNSUPPORTED, windowed_full_pool())
        if self._dsa is not None:  # its index pool (``sglang.dsa``)
            index = accept_index_pool(reg, ours, self._dsa, self._limits)
            if isinstance(index, Refusal):
                return index
            return Accepted(index.registration, ours, index.index)
        if self._mamba is not None:  # a mamba pool (``sglang.mamba``), or none at all
            pool = accept_mamba(reg, self._mamba, self._limits)
            if isinstance(pool, Refusal):
                return pool
            try:
                share = self._share(pool.registration, pool.state)
            except NIXL_ERRORS as exc:
                why = f"NIXL cannot list our staged state for the decode: {exc}"
                return Refusal(RejectReason.NIXL_REFUSED, why)
            return Accepted(pool.registration, ours, pool.state, share)
        return Accepted(reg, ours)

    def refuse_slices(self, state: StateRegions | None) -> Refusal | None:
        """Why a decode rank holding other heads than ours cannot take its state pool
        ``state`` as token runs of ours: a hybrid SWA pool fed from a windowed sliding pool
        (not built); None otherwise."""
        if state is not None and self._sliding is not None and self._sliding.pool_pages:
            return Refusal(RejectReason.UNSUPPORTED, windowed_slices())  # its one kind: swa
        return None

    def route(
        self, ours: KVLayout, peer: KVRegions, state: StateLists | None, is_whole: bool = True
    ) -> WindowRoute | None:
        """Where each page's regions go for a decode holding a hybrid SWA pool (whole pages,
        or, ``is_whole`` False, its head slice's token runs); else None."""
        return window_route(self._sliding, ours, peer, state, is_whole)

    def want(
        self, req: TransferRequest, peer: SglangPeer
    ) -> tuple[wire.Want | Refusal, TransferRequest]:
        """The request's want, its state indices read as its component's (the request then
        without them), or the refusal of indices that do not fit."""
        if peer.route is not None:  # its window pages are state indices (``sglang.swa``)
            return window_want(req), dataclasses.replace(req, has_state=False)
        if self._dsa is not None:  # its index pages are its KV pages (``sglang.dsa``)
            return index_want(req), dataclasses.replace(req, has_state=False)
        if peer.state is not None:  # its mamba slot is the state index (``sglang.mamba``)
            return mamba_want(req), dataclasses.replace(req, has_state=False)
        return req.want(), req

    def _share(self, reg: Registration, state: StateRegions) -> StateLists | None:
        """For a mamba decode rank of attention TP > 1: the share of our staged slots it
        takes (``state`` its pool, of that share), listed once per (rank, TP size); None at
        TP 1 (whole slots)."""
        if reg.tp_size == 1 or self._mamba is None:
            return None
        key = (reg.tp_rank, reg.tp_size)
        if key not in self._shares:
            staged = self._mamba.stage.regions()
            share = self._run(prep_share, self._agent, staged, state.component, reg.tp_rank)
            self._shares[key] = share
        return self._shares[key]

    def release(self) -> None:
        """The staged shares' lists (at close, before the agent)."""
        for share in self._shares.values():
            share.prepped.release()
        self._shares.clear()
