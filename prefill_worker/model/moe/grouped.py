"""The grouped MoE backend (torch ops, any device): tokens grouped by expert, one pair of
GEMMs per expert.

The ``T * k`` (token, expert) assignments are sorted by expert (a stable argsort), the
tokens gathered into that order once, and each expert that has tokens runs
``silu(x We_gate) * (x We_up) We_down`` over its contiguous block: every expert's weights
are read once per forward, whatever the number of tokens, and the Python loop is over
experts, never tokens. The outputs, scaled by their routing weights, are summed back into
their tokens with one ``index_add_``.
"""

from __future__ import annotations

import torch

from prefill_worker.model.layers import silu_and_mul_
from prefill_worker.model.moe.base import MoEWeights
from prefill_worker.model.quant.linear import Weight, linear, linear_into


class TorchGroupedExperts:
    name = "grouped"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, weights: MoEWeights) -> MoEWeights:
        return weights  # the loader's gate-first stacks, as they are

    def experts(
        self,
        x: torch.Tensor,  # [T, hidden]
        weights: torch.Tensor,  # [T, k], x's dtype
        ids: torch.Tensor,  # [T, k] int64
        gate_up: Weight,  # [E, 2I, hidden], gate rows first (FP8: one block GEMM an expert)
        down: Weight,  # [E, hidden, I]
    ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``: ``[T, hidden]``."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)  # [T k]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // top_k  # [T k], the token of each sorted assignment
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        rows = x.index_select(0, token_of)  # [T k, hidden], in expert order
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            block = slice(start, start + count)
            hidden = silu_and_mul_(linear(rows[block], gate_up[expert]))  # [n, I]
            linear_into(hidden, down[expert], None, out_rows[block])
            start += count
        out_rows.mul_(weights.reshape(-1)[order, None])
        out = torch.zeros_like(x)
        return out.index_add_(0, token_of, out_rows)
