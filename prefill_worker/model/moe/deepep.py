"""Expert parallelism's token exchange through DeepEP's normal-mode kernels (``deep_ep``):
the ``deepep`` entry of the exchange registry (``model.moe.ep``), registered only where
``deep_ep`` imports (CUDA hosts with NVLink/RDMA; not on this project's CPU CI).

DeepEP places experts contiguously (rank r: ``[r E / N, (r + 1) E / N)``), so an explicit
placement is refused. Its dispatch sends each token once to every rank that owns one of its
experts, with its top-k ids rewritten to that rank's local ids (-1 where another rank owns
the expert); the owner computes the weighted sum of its experts per received token, and the
combine adds the ranks' sums back into each token::

    layout   = buffer.get_dispatch_layout(ids, E)
    recv_x, recv_ids, recv_w, _, handle, _ = buffer.dispatch(x, ids, w, *layout)
    out      = run_local_experts(recv_x, recv_w, recv_ids, experts)   (slots >= 0 only)
    combined = buffer.combine(out, handle)

Tested on a GPU only (``tests/gpu/test_ep_deepep.py``); not run where this was written.
"""

from __future__ import annotations

from typing import Any

import torch

from prefill_worker.model.moe.alltoall import LocalExperts, run_local_experts
from prefill_worker.model.moe.placement import ExpertPlacement, contiguous


class DeepEPExchange:
    name = "deepep"

    def __init__(
        self, rank: int, placement: ExpertPlacement, group: Any, device: torch.device
    ) -> None:
        from deep_ep import Buffer  # CUDA only: imported when chosen

        if placement != contiguous(placement.num_experts, placement.size):
            raise ValueError("expert-parallel exchange 'deepep' places experts contiguously only")
        self.rank, self.placement, self.group, self.device = rank, placement, group, device
        self._buffer_type = Buffer
        self._buffer: Any = None

    def dispatch_combine(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: LocalExperts
    ) -> torch.Tensor:
        buffer = self._buffer_for(x)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids, self.placement.num_experts
        )
        recv_x, recv_ids, recv_w, _, handle, _ = buffer.dispatch(
            x,
            topk_idx=ids,
            topk_weights=weights.float(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        out = run_local_experts(recv_x, recv_w, recv_ids, experts)
        combined, _, _ = buffer.combine(out, handle)
        return combined

    def _buffer_for(self, x: torch.Tensor) -> Any:
        """DeepEP's communication buffer, sized by its own hints for ``x``'s row bytes."""
        if self._buffer is None:
            size = self.placement.size
            row_bytes = x.shape[1] * max(x.element_size(), 2)
            configs = (
                self._buffer_type.get_dispatch_config(size),
                self._buffer_type.get_combine_config(size),
            )
            nvl = max(c.get_nvl_buffer_size_hint(row_bytes, size) for c in configs)
            rdma = max(c.get_rdma_buffer_size_hint(row_bytes, size) for c in configs)
            self._buffer = self._buffer_type(self.group, nvl, rdma)
        return self._buffer
