"""A sparse MoE MLP block: its fused weights, how they load, and its forward.

Weights load from HF's per-expert tensors (``mlp.experts.{e}.gate_proj/up_proj/down_proj``)
and are stacked once: ``gate_up [E, 2I, hidden]`` (each expert's gate rows, then its up
rows) and ``down [E, hidden, I]``. DeepSeek's shared experts are a dense MLP
(``mlp.shared_experts.*``) fused like the dense layers' (``[2 I_s, hidden]``, ``[hidden, I_s]``);
Qwen3-Next's one shared expert (``mlp.shared_expert.*``) likewise, its output scaled per token
by ``sigmoid(h @ shared_expert_gate)``.

Under tensor parallelism each rank holds every expert's slice of the intermediate dimension
(gate/up rows, down columns) and the whole router; the routed experts' partial sum and the
shared experts' partial sum are added, then summed over the ranks by ONE all-reduce (the same
collective as a dense MLP's down projection)::

    weights, ids = route(h)                        [T, k] each, same on every rank
    out = experts(h, weights, ids) + shared(h)     [T, hidden], this rank's partial sum
    all_reduce(out)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from prefill_worker.model.hf_config import MoESpec
from prefill_worker.model.layers import silu_and_mul_
from prefill_worker.model.moe.base import ExpertsBackend, MoEWeights
from prefill_worker.model.moe.routing import route
from prefill_worker.model.parallel import SINGLE, TPGroup, all_reduce_
from prefill_worker.model.quant.linear import Weight, cat_rows, linear, stack


def moe_mlp(
    h: torch.Tensor,
    weights: MoEWeights,
    spec: MoESpec,
    backend: ExpertsBackend,
    tp: TPGroup = SINGLE,
) -> torch.Tensor:
    """``h [T, hidden]`` (the post-attention-normed residual) -> the block's output."""
    topk_weights, ids = route(h, weights.router, weights.score_bias, spec)
    out = backend.experts(h, topk_weights, ids, weights.gate_up, weights.down)
    if weights.shared_gate_up is not None and weights.shared_down is not None:
        shared = linear(silu_and_mul_(linear(h, weights.shared_gate_up)), weights.shared_down)
        if weights.shared_gate is not None:
            shared.mul_(F.linear(h, weights.shared_gate).sigmoid())
        out.add_(shared)
    return all_reduce_(out, tp)


def fuse_moe(
    spec: MoESpec,
    get: Callable[[str], torch.Tensor],
    mlp: str,
    local_experts: Sequence[int] | None = None,
    linear_weight: Callable[[str], Weight] | None = None,
) -> MoEWeights:
    """Stack the per-expert tensors under ``mlp`` (e.g. ``model.layers.3.mlp.``), as
    ``get(name)`` reads them (this rank's slice of each), into ``MoEWeights``; under
    expert parallelism only ``local_experts`` (this rank's, whole), in that order. The
    experts' and shared experts' projections as ``linear_weight`` reads them, if given (FP8
    kept)."""
    lin = linear_weight or get
    numbers = range(spec.num_experts) if local_experts is None else local_experts
    experts = [f"{mlp}experts.{e}." for e in numbers]
    gate_up = stack(
        [cat_rows([lin(e + "gate_proj.weight"), lin(e + "up_proj.weight")]) for e in experts]
    )
    down = stack([lin(e + "down_proj.weight") for e in experts])
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_gate = None
    if spec.shared_expert_size:  # Qwen3-Next: one gated shared expert
        shared = mlp + "shared_expert."
        shared_gate_up = cat_rows([lin(shared + n + "_proj.weight") for n in ("gate", "up")])
        shared_down = lin(shared + "down_proj.weight")
        shared_gate = get(mlp + "shared_expert_gate.weight")
    if spec.num_shared_experts:
        shared = mlp + "shared_experts."
        shared_gate_up = cat_rows([lin(shared + n + "_proj.weight") for n in ("gate", "up")])
        shared_down = lin(shared + "down_proj.weight")
    score_bias = get(mlp + "gate.e_score_correction_bias").float() if spec.has_score_bias else None
    return MoEWeights(
        router=get(mlp + "gate.weight"),
        score_bias=score_bias,
        gate_up=gate_up,
        down=down,
        shared_gate_up=shared_gate_up,
        shared_down=shared_down,
        shared_gate=shared_gate,
    )


def moe_shapes(spec: MoESpec, hidden: int, mlp: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a sparse layer's MLP (under ``mlp``) must hold, with its shape."""
    inter, num_experts = spec.intermediate_size, spec.num_experts
    shapes: dict[str, tuple[int, ...]] = {mlp + "gate.weight": (num_experts, hidden)}
    for e in range(num_experts):
        p = f"{mlp}experts.{e}."
        shapes |= {p + "gate_proj.weight": (inter, hidden), p + "up_proj.weight": (inter, hidden)}
        shapes[p + "down_proj.weight"] = (hidden, inter)
    if spec.num_shared_experts:
        p, shared = mlp + "shared_experts.", inter * spec.num_shared_experts
        shapes |= {p + "gate_proj.weight": (shared, hidden), p + "up_proj.weight": (shared, hidden)}
        shapes[p + "down_proj.weight"] = (hidden, shared)
    if spec.shared_expert_size:
        p, shared = mlp + "shared_expert.", spec.shared_expert_size
        shapes |= {p + "gate_proj.weight": (shared, hidden), p + "up_proj.weight": (shared, hidden)}
        shapes[p + "down_proj.weight"] = (hidden, shared)
        shapes[mlp + "shared_expert_gate.weight"] = (1, hidden)
    if spec.has_score_bias:
        shapes[mlp + "gate.e_score_correction_bias"] = (num_experts,)
    return shapes
