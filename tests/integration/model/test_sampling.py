"""First-token sampling: seeds, greedy equivalence, the temperature distribution, top-p, and
no NaN whatever the parameters and logits (hypothesis over extreme values)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_worker.model.sampling import TEMPERATURE_FLOOR, filtered_probs, sample
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
    tokens, logprobs, errors = sample(
        LOGITS[None], [SamplingParams(temperature=5.0, top_k=2, seed=3)]
    )
    assert errors == [None]
    assert logprobs[0] == pytest.approx(torch.log_softmax(LOGITS, -1)[tokens[0]].item(), abs=1e-6)


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


# ── extreme values (issue #12: top_p=1e-300 or temperature=1e-39 crashed the worker) ──────────

VOCAB = 37
FP32_MAX = float(torch.finfo(torch.float32).max)
temperatures = st.one_of(
    st.just(0.0),
    st.floats(min_value=0.0, max_value=100.0),
    st.sampled_from([1e-45, 1e-39, 1e-30, 1e-8, TEMPERATURE_FLOOR, 1.0001e-5, 1e-4, 100.0]),
)
top_ps = st.one_of(
    st.floats(min_value=5e-324, max_value=1.0, exclude_min=False),
    st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0 - 1e-16, 1.0]),
)
top_ks = st.integers(min_value=0, max_value=VOCAB + 5)
logit_values = st.one_of(
    st.floats(min_value=-FP32_MAX, max_value=FP32_MAX, width=32),
    st.sampled_from([math.inf, -math.inf, FP32_MAX, -FP32_MAX, 1e30, -1e30, 0.0]),
)
params = st.builds(
    SamplingParams,
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1)),
)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.lists(logit_values, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=4),
    ps=st.lists(params, min_size=4, max_size=4),
)
def test_any_valid_params_and_non_nan_logits_sample_a_token(rows, ps) -> None:
    logits = torch.tensor(rows, dtype=torch.float32)
    ps = ps[: len(rows)]
    assert all(p.problem() is None for p in ps)
    tokens, logprobs, errors = sample(logits, ps)
    for row, (token, logprob, error) in enumerate(zip(tokens, logprobs, errors, strict=True)):
        if bool(torch.isneginf(logits[row]).all()):
            assert error == "SamplingError: every logit is -inf"
            assert token == -1 and math.isnan(logprob)
            continue
        assert error is None, (rows[row], ps[row])
        assert 0 <= token < VOCAB
        assert not math.isnan(logprob) and logprob <= 0.0
        assert logits[row, token] > -math.inf  # never a token the logits rule out
        posinf = torch.isposinf(logits[row])
        if bool(posinf.any()):
            assert bool(posinf[token])  # +inf logits take all the mass


@settings(max_examples=100, deadline=None)
@given(
    logits=st.lists(st.floats(-1e4, 1e4, width=32), min_size=VOCAB, max_size=VOCAB),
    p=params,
)
def test_filtered_probs_are_a_distribution_holding_the_top_token(logits, p) -> None:
    x = torch.tensor(logits)
    probs = filtered_probs(x, p)
    assert probs.dtype == torch.float64
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
    assert float(probs[x == x.max()].sum()) > 0.0  # a most likely token (ties: any of them)


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
        SamplingParams(temperature=1e-39, seed=1),
        SamplingParams(temperature=1e-39, top_p=1e-300, top_k=3, seed=1),
        SamplingParams(temperature=100.0, top_p=5e-324, seed=1),
    ],
)
def test_issue_12_values_give_the_greedy_token(p: SamplingParams) -> None:
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(7)) * 30
    tokens, _, errors = sample(logits, [p, p])
    assert errors == [None, None]
    assert tokens == logits.argmax(-1).tolist()


def test_a_bad_row_fails_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = math.nan
    ps = [SamplingParams(temperature=0.9, seed=s) for s in range(3)]
    tokens, _, errors = sample(logits, ps)
    assert errors[1] == "SamplingError: the logits hold NaN" and tokens[1] == -1
    assert errors[0] is None and errors[2] is None
    assert tokens[0] >= 0 and tokens[2] >= 0


def test_plus_inf_logits_share_the_mass() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = logits[0, 8] = math.inf
    greedy = sample(logits, [SamplingParams()])
    assert greedy.token_ids == [3] and greedy.logprobs[0] == pytest.approx(math.log(0.5))
    drawn = {
        sample(logits, [SamplingParams(temperature=1.0, seed=s)]).token_ids[0] for s in range(50)
    }
    assert drawn == {3, 8}


def test_top_p_keeps_a_most_likely_token_when_probabilities_round_equal() -> None:
    x = torch.zeros(8)
    x[5] = 1e-45  # above the others, yet every softmax probability rounds to 1/8
    probs = filtered_probs(x, SamplingParams(temperature=1.0, top_p=1e-300, seed=1))
    assert float(probs[5]) == 1.0
