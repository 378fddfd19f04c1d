"""Routers: each token's top-k experts and their weights, from the router's logits.

Both work on packed tokens and return ``(weights [T, k] in x's dtype, expert ids [T, k]
int64)``; the order of a token's k choices does not matter to the experts' sum. Scores are
computed in fp32 (as transformers does), whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefill_worker.model.hf_config import MoESpec


def route(
    x: torch.Tensor, router: torch.Tensor, score_bias: torch.Tensor | None, spec: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, hidden]`` through ``router [E, hidden]`` -> ``(weights, ids)`` ``[T, k]``."""
    if spec.scoring == "sigmoid":
        logits = F.linear(x.float(), router.float())  # [T, E] fp32, as DeepSeek-V3 does
        weights, ids = grouped_sigmoid_topk(logits, score_bias, spec)
    else:
        weights, ids = softmax_topk(F.linear(x, router), spec.top_k, spec.norm_topk_prob)
    return weights.to(x.dtype), ids


def softmax_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE (and Mixtral-style) routing: softmax over every expert, then the top k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_topk(
    logits: torch.Tensor, score_bias: torch.Tensor | None, spec: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (``noaux_tc``): sigmoid scores; experts are chosen on the scores
    plus the load-balancing bias, only within the ``topk_group`` groups whose two best
    biased scores sum highest; each chosen expert is weighted by its plain score."""
    num_tokens, num_experts = logits.shape
    scores = logits.sigmoid()  # [T, E]
    biased = scores if score_bias is None else scores + score_bias.float()
    grouped = biased.view(num_tokens, spec.n_group, num_experts // spec.n_group)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(spec.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = keep[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    ids = biased.masked_fill(~allowed, float("-inf")).topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # [T, k]
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids
