"""What an MoE experts backend is (``ExpertsBackend``) and the weights it computes with
(``MoEWeights``): the registry (``__init__``), the block and every backend import these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from prefill_worker.model.quant.linear import Weight


@dataclass(frozen=True, slots=True, eq=False)
class MoEWeights:
    """One sparse layer's MLP; under TP, this rank's intermediate slice of each expert."""

    router: torch.Tensor  # [E, hidden]
    score_bias: torch.Tensor | None  # [E] fp32 (DeepSeek-V3's e_score_correction_bias)
    gate_up: Weight  # [E, 2I, hidden] (FP8 kept: one Fp8BlockWeight stack, quant.linear)
    down: Weight  # [E, hidden, I]
    shared_gate_up: Weight | None  # [2 I_s, hidden] (DeepSeek's shared experts)
    shared_down: Weight | None  # [hidden, I_s]
    shared_gate: torch.Tensor | None = None  # [1, hidden] (Qwen3-Next: sigmoid(h @ w) scales it)


class ExpertsBackend(Protocol):
    name: str

    def prepare(self, weights: MoEWeights) -> MoEWeights:
        """The layer's weights in the layout ``experts`` wants (called once per layer)."""
        ...

    def experts(
        self,
        x: torch.Tensor,  # [T, hidden]
        weights: torch.Tensor,  # [T, k], x's dtype
        ids: torch.Tensor,  # [T, k] int64
        gate_up: Weight,  # [E, 2I, hidden], gate rows first
        down: Weight,  # [E, hidden, I]
    ) -> torch.Tensor: ...
