"""First-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

The reported logprob is that of the chosen token under the unmodified (temperature 1, no
filtering) softmax, whatever the sampling parameters. Random draws happen on the CPU with a
``torch.Generator`` seeded from the request, so a seed gives the same token on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_worker.request import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[list[int], list[float]]:
    """``logits [R, vocab]`` -> one ``(token_id, logprob)`` per row, as two lists."""
    assert logits.shape[0] == len(params)
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # [R]
    for row, p in enumerate(params):
        if not p.is_greedy:
            tokens[row] = sample_row(logits[row].cpu(), p)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def sample_row(logits: torch.Tensor, p: SamplingParams) -> int:
    """One draw from ``logits [vocab]`` (fp32, CPU) after temperature, top-k and top-p."""
    probs = filtered_probs(logits, p)
    generator = torch.Generator(device=logits.device)
    if p.seed is None:
        generator.seed()
    else:
        generator.manual_seed(p.seed)
    return int(torch.multinomial(probs, 1, generator=generator))


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: ``[vocab]``, sums to 1."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ranked above
        drop = before >= p.top_p  # never drops the most likely token (before == 0)
        probs = probs.clone()
        probs[order[drop]] = 0.0
        probs = probs / probs.sum()
    return probs
