"""Expert parallelism's token exchange over ``torch.distributed`` all-to-all (gloo on CPU,
NCCL on CUDA): the ``torch`` entry of the exchange registry (``model.moe.ep``).

An exchange takes THIS rank's tokens (any count, different on every rank: attention-DP ranks
will call it with their own batches) and returns their routed experts' weighted sum; the
experts live whole on their owners (``placement.ExpertPlacement``)::

    assignments (t, j) of the local tokens, sorted by (owner, owner's local expert)
    counts      all_gather of each rank's per-expert count [E]   -> [N, E] on every rank
                (so each rank knows what it sends to and receives from every other)
    dispatch    all_to_all of the sorted rows [t k, hidden], variable splits
    compute     the owner runs its experts over what it received (rows from rank s for
                its local expert j: counts[s, j], in that order, so no ids travel)
    combine     all_to_all of the expert outputs back, the reverse splits
    sum         each returned row times its routing weight, index_add_ into its token

The routing weights never leave their rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from prefill_worker.model.moe.placement import ExpertPlacement

LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(rows [R, hidden], weights [R, k'], local ids [R, k'])`` -> ``[R, hidden]``: this
rank's experts' weighted sum per row (an experts backend bound to this rank's weights)."""


class TorchAllToAll:
    name = "torch"

    def __init__(
        self, rank: int, placement: ExpertPlacement, group: Any, device: torch.device
    ) -> None:
        self.rank, self.placement, self.group = rank, placement, group
        by_owner = [e for r in range(placement.size) for e in placement.local_experts(r)]
        self._sort_key = torch.empty(placement.num_experts, dtype=torch.int64, device=device)
        self._sort_key[torch.tensor(by_owner, device=device)] = torch.arange(
            placement.num_experts, device=device
        )  # [E]: expert -> its place in owner-major order
        self._owner = torch.tensor(placement.owner, dtype=torch.int64, device=device)  # [E]
        self._mine = torch.tensor(placement.local_experts(rank), dtype=torch.int64, device=device)

    def dispatch_combine(
        self,
        x: torch.Tensor,  # [t, hidden], this rank's tokens
        weights: torch.Tensor,  # [t, k]
        ids: torch.Tensor,  # [t, k] int64, global expert ids
        experts: LocalExperts,
    ) -> torch.Tensor:
        """``sum_j weights[i, j] * expert_{ids[i, j]}(x[i])`` for this rank's ``t`` tokens,
        each expert computed by its owner: ``[t, hidden]``."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)  # [t k]
        order = torch.argsort(self._sort_key[flat], stable=True)
        token_of = order // top_k  # [t k]: the token of each sorted assignment
        counts = self._all_counts(torch.bincount(flat, minlength=self.placement.num_experts))
        send = torch.zeros(self.placement.size, dtype=torch.int64, device=x.device)
        send.index_add_(0, self._owner, counts[self.rank])  # [N]: rows to each owner
        mine = counts[:, self._mine]  # [N, E_local]: rows from each rank, per local expert
        send_splits, recv_splits = send.tolist(), mine.sum(dim=1).tolist()
        received = self._exchange(x.index_select(0, token_of), recv_splits, send_splits)
        local_ids = torch.arange(len(self._mine), device=x.device).repeat(self.placement.size)
        local_ids = local_ids.repeat_interleave(mine.reshape(-1))[:, None]  # [R, 1]
        ones = torch.ones(local_ids.shape, dtype=x.dtype, device=x.device)
        returned = self._exchange(experts(received, ones, local_ids), send_splits, recv_splits)
        returned.mul_(weights.reshape(-1)[order, None])
        return torch.zeros_like(x).index_add_(0, token_of, returned)

    def _all_counts(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's per-expert assignment counts: ``[N, E]``."""
        gathered = [torch.empty_like(local) for _ in range(self.placement.size)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered)

    def _exchange(
        self, rows: torch.Tensor, recv_splits: list[int], send_splits: list[int]
    ) -> torch.Tensor:
        out = rows.new_empty((sum(recv_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=self.group)
        return out
