"""First-token sampling: seeds, greedy equivalence, the temperature distribution, top-p."""

from __future__ import annotations

import math

import torch

from prefill_worker.model.sampling import filtered_probs, sample
from prefill_worker.request import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def test_same_seed_same_token():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.5, seed=42)
    first = [sample(logits, [p])[0][0] for _ in range(5)]
    assert len(set(first)) == 1
    others = {sample(logits, [SamplingParams(temperature=1.5, seed=s)])[0][0] for s in range(20)}
    assert len(others) > 1  # the seed matters


def test_top_k_1_equals_greedy():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(1))
    greedy = sample(logits, [SamplingParams()] * 4)
    top1 = sample(logits, [SamplingParams(temperature=0.8, top_k=1, seed=s) for s in range(4)])
    assert greedy == top1
    assert greedy[0] == logits.argmax(-1).tolist()


def test_logprob_is_under_the_unmodified_softmax():
    tokens, logprobs = sample(LOGITS[None], [SamplingParams(temperature=5.0, top_k=2, seed=3)])
    assert logprobs[0] == torch.log_softmax(LOGITS, -1)[tokens[0]].item()


def test_temperature_sampling_follows_the_distribution():
    temperature, draws = 0.7, 3000
    p = torch.softmax(LOGITS / temperature, -1)
    counts = torch.zeros(len(LOGITS))
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(draws)]
    for token in sample(LOGITS.expand(draws, -1), params)[0]:
        counts[token] += 1
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom
    assert abs(counts[5] / draws - p[5]) < 0.05


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # sorted: 3.0, 2.0, 1.0, ... -> ~0.61, 0.22, 0.08
    kept = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert (kept > 0).tolist() == [True, False, False, False, False, True]
    assert math.isclose(float(kept.sum()), 1.0, rel_tol=1e-6)
    assert math.isclose(float(kept[5] / kept[0]), float(probs[5] / probs[0]), rel_tol=1e-5)
    only = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.1))
    assert (only > 0).tolist() == [False] * 5 + [True]
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=s) for s in range(200)]
    assert set(sample(LOGITS.expand(200, -1), params)[0]) == {0, 5}
