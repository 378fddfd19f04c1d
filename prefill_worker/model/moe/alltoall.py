"""Expert parallelism's token exchange over ``torch.distributed`` all-to-all (gloo on CPU,
NCCL on CUDA): the ``torch`` entry of the exchange registry (``model.moe.ep``).

An exchange takes THIS rank's tokens (any count, different on every rank: attention-DP ranks
will call it with their own batches) and returns their routed experts' weighted sum; the
experts live whole on their owners (``placement.ExpertPlacement``). Each token travels once
to each rank that owns at least one of its k experts (not once per expert: at top 8 over 2
ranks that is 2 rows, not 8), with its k slots rewritten for that rank (DeepEP's scheme)::

    needs [t, N]    does token i use an expert of rank d
    counts          all_to_all of each rank's row counts (one int per pair of ranks)
    dispatch        all_to_all of the rows x[i], grouped by destination rank, each with
                    its k slots: the owner's local expert id (-1: another rank's) and the
                    routing weight, packed as 2k more columns: one all_to_all, in x's
                    dtype where it holds the ids exactly (else in fp32)
    compute         the owner runs its experts over every valid (row, slot), weighted,
                    summed per row
    combine         all_to_all of the per-row sums back, the reverse splits; each is
                    index_add_-ed into its token
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from prefill_worker.model.moe.placement import ExpertPlacement

# The largest count of consecutive integers a dtype holds exactly (its mantissa's reach).
_EXACT_INTS = {torch.float32: 1 << 24, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}

LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(rows [R, hidden], weights [R, k'], local ids [R, k'])`` -> ``[R, hidden]``: this
rank's experts' weighted sum per row (an experts backend bound to this rank's weights)."""


class TorchAllToAll:
    name = "torch"

    def __init__(
        self, rank: int, placement: ExpertPlacement, group: Any, device: torch.device
    ) -> None:
        self.rank, self.placement, self.group = rank, placement, group
        self._owner = torch.tensor(placement.owner, dtype=torch.int64, device=device)  # [E]
        local = torch.zeros(placement.num_experts, dtype=torch.int64)
        for rank_r in range(placement.size):
            for index, expert in enumerate(placement.local_experts(rank_r)):
                local[expert] = index
        self._local_index = local.to(device)  # [E]: expert -> its index on its owner
        self._max_local = placement.max_local()

    def dispatch_combine(
        self,
        x: torch.Tensor,  # [t, hidden], this rank's tokens
        weights: torch.Tensor,  # [t, k]
        ids: torch.Tensor,  # [t, k] int64, global expert ids
        experts: LocalExperts,
    ) -> torch.Tensor:
        """``sum_j weights[i, j] * expert_{ids[i, j]}(x[i])`` for this rank's ``t`` tokens,
        each expert computed by its owner: ``[t, hidden]``."""
        size = self.placement.size
        owners = self._owner[ids]  # [t, k]
        needs = torch.zeros(x.shape[0], size, dtype=torch.bool, device=x.device)
        needs.scatter_(1, owners, True)  # [t, N]
        dest, token = needs.t().nonzero(as_tuple=True)  # rows grouped by destination rank
        send_splits = torch.bincount(dest, minlength=size)
        recv_splits = self._exchange_counts(send_splits)
        send, recv = send_splits.tolist(), recv_splits.tolist()
        slot_ids = self._local_index[ids[token]].masked_fill(owners[token] != dest[:, None], -1)
        rows, local_ids, local_weights = self._dispatch(x, token, slot_ids, weights, recv, send)
        sums = run_local_experts(rows, local_weights, local_ids, experts)
        back = self._exchange(sums, send, recv)
        return torch.zeros_like(x).index_add_(0, token, back)

    def _dispatch(
        self,
        x: torch.Tensor,  # [t, hidden]
        token: torch.Tensor,  # [S], the token of each row to send
        slot_ids: torch.Tensor,  # [S, k] int64, the destination's local ids (-1: not its)
        weights: torch.Tensor,  # [t, k]
        recv: list[int],
        send: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows, their slots' local ids and weights, as this rank receives them: one
        all-to-all of ``[S, hidden + 2k]``, in x's dtype where it holds the local ids exactly
        (bf16: up to 256 experts a rank; the weights are in x's dtype already), else fp32."""
        top_k, hidden = slot_ids.shape[1], x.shape[1]
        exact = self._max_local <= _EXACT_INTS.get(x.dtype, 0)
        wire = x.dtype if exact else torch.float32
        parts = (x[token], slot_ids, weights[token])
        packed = torch.cat([part.to(wire) for part in parts], dim=1)  # [S, hidden + 2k]
        got = self._exchange(packed, recv, send)
        rows, slots = got[:, :hidden].to(x.dtype), got[:, hidden:]
        return rows, slots[:, :top_k].long(), slots[:, top_k:]

    def _exchange_counts(self, send_splits: torch.Tensor) -> torch.Tensor:
        """How many rows each rank sends this one (``send_splits`` of every rank, transposed)."""
        recv_splits = torch.empty_like(send_splits)
        dist.all_to_all_single(recv_splits, send_splits, group=self.group)
        return recv_splits

    def _exchange(
        self, rows: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ) -> torch.Tensor:
        out = rows.new_empty((sum(recv_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=self.group)
        return out


def run_local_experts(
    rows: torch.Tensor,  # [R, hidden], received
    weights: torch.Tensor,  # [R, k]
    local_ids: torch.Tensor,  # [R, k] int64, this rank's expert index; -1: another rank's
    experts: LocalExperts,
) -> torch.Tensor:
    """Every row's weighted sum over its slots that name this rank's experts: ``[R, hidden]``
    (the other slots cost nothing: only valid (row, slot) pairs reach the experts)."""
    row, slot = (local_ids >= 0).nonzero(as_tuple=True)
    weight = weights[row, slot, None].to(rows.dtype)  # [A, 1]
    out = experts(rows.index_select(0, row), weight, local_ids[row, slot, None])
    return torch.zeros_like(rows).index_add_(0, row, out)
