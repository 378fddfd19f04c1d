"""Our linear layers' state slots staged in SGLang's ``MambaPool`` layout (``sglang.mamba``),
and the sender that stages a request's slot when its last chunk is done.

The staging pool has one slot per state slot of ours (a request's state slot is its aux row,
held from admission to finish, so a staging slot is never shared and is back when the aux row
is), in the decode's layout, registered once with NIXL as the SGLang backend's state pool::

    conv      per linear layer [slots, conv_dim, kernel - 1]       conv_dtype (the decode's)
    temporal  per linear layer [slots, v_heads, head_v_dim, head_k_dim]   float32
              = ours [slots, v_heads, head_k_dim, head_v_dim], the last two transposed

``fill(slot, d)`` copies our slot there (cast, transposed; for a decode of d ranks the
conv's channels rank after rank: each rank's q, k, v shares, then the next rank's) on the
engine thread, when the
engine hands the request its aux row (``StagingSender.send_aux``: after the last chunk's
forward, so the slot holds the state after the whole prompt), before any byte of it is
written; a CUDA pool's copy is waited for before it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from prefill_worker.kv.state_layout import (
    LINEAR_STATE,
    StateComponent,
    StateRegions,
    StateTensor,
)
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import ForwardingSender, KVSender
from prefill_worker.transfer.nixl.poster import Write
from prefill_worker.transfer.slot_stage import SlotStage

CONV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TEMPORAL_DTYPE = torch.float32  # SGLang's mamba_ssm_dtype unless its config or env says more


class MambaStage:
    """``SlotStage`` over a state pool's per-layer tensors (``model.state_cache``: conv ``[S,
    conv_dim, K - 1]`` and recurrent ``[S, Hv, Dk, Dv]`` per linear layer)."""

    def __init__(
        self,
        layer_ids: tuple[int, ...],
        conv: Sequence[torch.Tensor],
        recurrent: Sequence[torch.Tensor],
        conv_dtype: str,
        device: str,
        conv_groups: tuple[int, ...] = (),
    ) -> None:
        """``conv_groups``: the conv's channel sub-blocks (a GDN conv: q, k, v), each split
        across a decode's ranks on its own; () for one block."""
        self._layer_ids, self._device = layer_ids, device
        self._groups = conv_groups or (conv[0].shape[1],)
        self._orders: dict[int, torch.Tensor] = {}  # conv channel order per decode TP size
        self._conv, self._recurrent = tuple(conv), tuple(recurrent)
        dtype = CONV_DTYPES[conv_dtype]
        self.conv = tuple(torch.zeros(c.shape, dtype=dtype, device=c.device) for c in conv)
        self.temporal = tuple(  # each [S, Hv, Dv, Dk]
            torch.zeros(r.transpose(-1, -2).shape, dtype=TEMPORAL_DTYPE, device=r.device)
            for r in recurrent
        )

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.temporal))

    def regions(self) -> StateRegions:
        conv, temporal = self.conv[0], self.temporal[0]
        tensors = (
            StateTensor("conv", tuple(conv.shape[1:]), _name(conv.dtype), _bytes(conv[0])),
            StateTensor("recurrent", tuple(temporal.shape[1:]), "float32", _bytes(temporal[0])),
        )
        component = StateComponent(LINEAR_STATE, self._layer_ids, tensors, conv.shape[0])
        bases = tuple(tuple(t.data_ptr() for t in ts) for ts in (self.conv, self.temporal))
        return StateRegions(component, bases, self._device)

    def fill(self, slot: int, num_shares: int = 1) -> None:
        channels = self._channels(num_shares)
        for ours, staged in zip(self._conv, self.conv, strict=True):
            staged[slot].copy_(ours[slot] if channels is None else ours[slot][channels])
        for ours, staged in zip(self._recurrent, self.temporal, strict=True):
            staged[slot].copy_(ours[slot].transpose(-1, -2))
        if self.conv[0].is_cuda:  # NIXL reads it next, outside any stream
            torch.cuda.current_stream(self.conv[0].device).synchronize()

    def _channels(self, num_shares: int) -> torch.Tensor | None:
        """Our conv channels rank after rank for ``num_shares`` ranks (each rank's share of
        every sub-block, in order); None when that is our order (one rank)."""
        if num_shares == 1:
            return None
        if num_shares in self._orders:
            return self._orders[num_shares]
        starts = [sum(self._groups[:i]) for i in range(len(self._groups))]
        order = [
            start + rank * (size // num_shares) + i
            for rank in range(num_shares)
            for start, size in zip(starts, self._groups, strict=True)
            for i in range(size // num_shares)
        ]
        self._orders[num_shares] = torch.tensor(order, device=self._conv[0].device)
        return self._orders[num_shares]


class RankedSender(KVSender, Protocol):
    """A sender that knows how many ranks its decode has, and which decode ranks it is bound
    to (``PushSender``; ``transfer.group.Bound``)."""

    @property
    def num_ranks(self) -> int: ...

    def bound(self) -> Sequence[tuple[Any, wire.Want]]: ...

    def also_wait_for(self, writes: Write) -> None: ...


class StagingSender(ForwardingSender):
    """A sender whose request's state slot is staged (``stage``) when its aux row is handed
    over, just before the inner sender is; everything else is the inner sender's, what a TP
    group's mirror asks of it too (``bound``, ``also_wait_for``: the followers write their
    KV heads beside it, ``transfer.group``)."""

    def __init__(self, inner: RankedSender, stage: SlotStage) -> None:
        super().__init__(inner)
        self._ranked, self._stage = inner, stage

    def send_aux(self, aux_row: int) -> None:
        if not self._inner.poll().is_terminal:
            self._stage.fill(aux_row, self._ranked.num_ranks)
        self._inner.send_aux(aux_row)

    def bound(self) -> Sequence[tuple[Any, wire.Want]]:
        return self._ranked.bound()

    def also_wait_for(self, writes: Write) -> None:
        self._ranked.also_wait_for(writes)


def _name(dtype: torch.dtype) -> str:
    return next(name for name, d in CONV_DTYPES.items() if d == dtype)


def _bytes(item: torch.Tensor) -> int:
    return item.numel() * item.element_size()
