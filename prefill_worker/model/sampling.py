"""First-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

The reported logprob is that of the chosen token under the unmodified (temperature 1, no
filtering) softmax, whatever the sampling parameters. Random draws happen on the CPU with a
``torch.Generator`` seeded from the request, so a seed gives the same token on any device.

Nothing a request asks for can make a probability NaN (docs/reliability.md):

- logits are read in float64, so ``logit / temperature`` stays finite for any fp32 logit and
  any temperature at or above ``TEMPERATURE_FLOOR``; a lower temperature is greedy;
- a row with +inf logits is the uniform choice among them (the limit of its softmax);
- top-k and top-p always keep the most likely token, so some mass is always left;
- a row no rule can rescue (a NaN logit, every logit -inf) fails alone: its ``error`` is set,
  and the other rows of the batch are sampled as usual. Any other exception in one row is
  caught the same way, so one request's sampling never fails the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from prefill_worker.request import SamplingParams

TEMPERATURE_FLOOR = 1e-5  # below it the distribution is one-hot in float64 anyway: greedy


class SamplingError(ValueError):
    """One row cannot be sampled (its logits are not a distribution)."""


class Samples(NamedTuple):
    """One entry per row; where ``errors[row]`` is set the row has no token (``-1``)."""

    token_ids: list[int]
    logprobs: list[float]
    errors: list[str | None]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams]) -> Samples:
    """``logits [R, vocab]`` -> one token id, logprob and error (None) per row."""
    assert logits.shape[0] == len(params)
    x = sanitized(logits.double())  # [R, vocab]
    greedy = x.argmax(dim=-1)  # [R]
    log_probs = torch.log_softmax(x, dim=-1)  # [R, vocab]
    logprobs = log_probs.gather(1, greedy[:, None])[:, 0]  # [R]
    samples = Samples(greedy.tolist(), logprobs.tolist(), [None] * len(params))
    bad = row_problems(x)
    for row, p in enumerate(params):
        try:
            if bad[row] is not None:
                raise SamplingError(bad[row])
            if not is_greedy(p):
                token = sample_row(x[row].cpu(), p)
                samples.token_ids[row] = token
                samples.logprobs[row] = float(log_probs[row, token])
        except Exception as exc:  # one row's failure is that request's, never the batch's
            samples.token_ids[row], samples.logprobs[row] = -1, math.nan
            samples.errors[row] = f"{type(exc).__name__}: {exc}"
    return samples


def is_greedy(p: SamplingParams) -> bool:
    return p.is_greedy or p.temperature < TEMPERATURE_FLOOR


def sanitized(x: torch.Tensor) -> torch.Tensor:
    """``x [R, vocab]`` with each row holding +inf replaced by 0 there and -inf elsewhere:
    softmax's limit (uniform over the +inf logits) without inf - inf = NaN."""
    has_posinf = x.isposinf().any(dim=-1, keepdim=True)  # [R, 1]
    if not bool(has_posinf.any()):
        return x
    limit = torch.where(x.isposinf(), 0.0, -math.inf).to(x.dtype)
    return torch.where(has_posinf, limit, x)


def row_problems(x: torch.Tensor) -> list[str | None]:
    """Per row of sanitized logits: why it is no distribution, or None."""
    has_nan = x.isnan().any(dim=-1).tolist()
    all_neginf = x.isneginf().all(dim=-1).tolist()
    return [
        "the logits hold NaN" if nan else "every logit is -inf" if neginf else None
        for nan, neginf in zip(has_nan, all_neginf, strict=True)
    ]


def sample_row(logits: torch.Tensor, p: SamplingParams) -> int:
    """One draw from ``logits [vocab]`` (float64, CPU) after temperature, top-k and top-p."""
    probs = filtered_probs(logits, p)
    generator = torch.Generator(device=logits.device)
    if p.seed is None:
        generator.seed()
    else:
        generator.manual_seed(p.seed)
    return int(torch.multinomial(probs, 1, generator=generator))


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: ``[vocab]`` float64, sums to 1.

    Raises ``SamplingError`` if no distribution is left (only possible for logits that
    ``row_problems`` would have refused)."""
    x = sanitized(logits.double()[None])[0]
    scaled = x / max(p.temperature, TEMPERATURE_FLOOR)  # finite: |fp32 max| / 1e-5 << fp64 max
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)  # ties with the k-th stay
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        # Ranked by the logits, not the probabilities: logits a hair apart can round to equal
        # probabilities, and the token kept first must be a most likely one.
        order = torch.sort(scaled, descending=True, stable=True).indices
        sorted_probs = probs[order]
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ranked above
        drop = before >= p.top_p
        drop[0] = False  # the most likely token always stays, whatever rounding says
        probs = probs.clone()
        probs[order[drop]] = 0.0
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise SamplingError("no finite distribution left after temperature, top-k and top-p")
    return probs
