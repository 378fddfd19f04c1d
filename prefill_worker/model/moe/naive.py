"""The reference MoE backend the benchmark compares against: every expert over every token.

Each expert runs on all ``T`` tokens and its output is masked by the routing weight (zero
for tokens that did not choose it): ``E`` times the FLOPs of the grouped backend, but no
gather. It is what a Python loop without grouping costs; kept as a registry entry so the
benchmark and tests go through the same seam.
"""

from __future__ import annotations

import torch

from prefill_worker.model.layers import silu_and_mul_
from prefill_worker.model.moe.base import MoEWeights
from prefill_worker.model.quant.linear import Weight, linear


class NaiveExperts:
    name = "naive"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, weights: MoEWeights) -> MoEWeights:
        return weights  # the loader's gate-first stacks, as they are

    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_up: Weight,
        down: Weight,
    ) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
        dense.scatter_(1, ids, weights)  # [T, E], the weight of each expert for each token
        out = torch.zeros_like(x)
        for expert in range(gate_up.shape[0]):
            hidden = silu_and_mul_(linear(x, gate_up[expert]))
            out.addcmul_(linear(hidden, down[expert]), dense[:, expert, None])
        return out
