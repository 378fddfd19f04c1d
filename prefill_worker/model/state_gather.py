"""A tensor-parallel group's hybrid state, gathered whole on the leader for the transfer.

Under tensor parallelism each rank's state pool (``state_cache.StateCache`` over
``sharding.local_linear``) holds its heads of every slot: its q, k and v conv channels and
its value heads' recurrent matrices. A decode gets a slot whole (docs/protocol.md, "State
components"), so after each forward that ends a prompt (a ``StateSpan`` with ``is_last``)
the ranks gather those requests' slots on the leader (``torch.distributed.gather`` to group
rank 0: one collective per tensor kind, every linear layer at once), which writes them into
a pool of whole slots, the one its transfer registers and sends::

    rank r's conv slot   [q_r | k_r | v_r]            (2 Kd + Vd) / N channels, K - 1 taps
    whole conv slot      [q_0 .. q_N-1 | k_0 .. k_N-1 | v_0 .. v_N-1]
    whole recurrent      rank 0's value heads, then rank 1's, ...        [Hv, Dk, Dv]

A whole slot has the index of the local one (a request's aux row), so it is held and freed
with it: nothing here allocates per request. The cost is one gather of a finished request's
local slot per rank (Qwen3-Next-80B in bf16 at TP 4: a quarter of its 74 MiB slot each) and
a whole pool on the leader (``num_slots`` whole slots beside its local ones). Followers keep
no whole pool.
"""

from __future__ import annotations

import torch

from prefill_worker.kv.state_layout import StateComponent
from prefill_worker.model.gdn import StateSpan
from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.model.parallel import TPGroup
from prefill_worker.model.state_cache import StateCache, linear_component


class StateGather:
    """Gathers finished requests' slots from every rank's ``local`` pool into ``whole``,
    the leader's pool of whole slots (None on a follower, which only contributes).
    ``component`` describes the whole slots on every rank."""

    def __init__(self, spec: LinearAttentionSpec, local: StateCache, tp: TPGroup) -> None:
        """``spec``: the whole model's linear layers (``local`` holds this rank's heads)."""
        assert not tp.is_single, "at TP 1 the local pool is whole"
        self.local, self.tp = local, tp
        dtype = local.stacked_conv.dtype
        self.component: StateComponent = linear_component(spec, local.num_slots, dtype)
        self.whole: StateCache | None = None
        if tp.rank == 0:
            self.whole = StateCache(spec, local.num_slots, dtype, local.device)

    def gather(self, spans: tuple[StateSpan, ...]) -> None:
        """The slots of the spans that end their prompt, from every rank into the leader's
        whole pool. A collective: every rank calls it after the same forward."""
        slots = [span.slot for span in spans if span.is_last]
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.local.device)
        conv = self._gather(self.local.stacked_conv.index_select(1, index))  # [L, n, C/N, K-1]
        recurrent = self._gather(self.local.stacked_recurrent.index_select(1, index))
        if self.whole is None:
            return
        local = self.local.spec
        runs = [part.split([local.key_dim, local.key_dim, local.value_dim], 2) for part in conv]
        whole_conv = torch.cat([run[block] for block in range(3) for run in runs], dim=2)
        self.whole.stacked_conv.index_copy_(1, index, whole_conv)
        self.whole.stacked_recurrent.index_copy_(1, index, torch.cat(recurrent, dim=2))

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``local``, in rank order, on the leader; [] on a follower."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)] if self.whole else None
        torch.distributed.gather(local, parts, group=self.tp.group, group_dst=0)
        return parts or []
