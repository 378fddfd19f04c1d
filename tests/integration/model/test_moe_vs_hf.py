"""Qwen3-MoE through our runner against transformers on the same random checkpoint.

Layers 0 and 2 are sparse (8 experts, top 2, normalised), layer 1 dense
(``mlp_only_layers``); q/k weights x20 and a router whose top-2 weights both matter, so a
routing, fusion or attention bug moves logits by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefill_worker.model.llama import CausalLM
from prefill_worker.model.moe.block import MoEWeights
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import (
    PAGE_SIZE,
    chunk,
    hf_forward,
    hf_model,
    ours,
    paged_kv,
    plan,
    prompt,
    scattered_pages,
)

TOL = 1e-4
# K is large here (|K| ~ 20: q/k x20 and q/k-norm weights in [2, 6]) and sharp attention
# amplifies fp32 rounding with depth: a DENSE 3-layer Qwen3 of this shape already differs from
# transformers by 1.7e-4 in layer 2's K (2.8e-4 with MoE), i.e. ~1e-5 relative. K gets that
# allowance relative to its scale (1e-4 per 5 units of max |K|); V and the logits stay at 1e-4.
K_PER_SCALE = 2e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


@pytest.fixture(scope="module")
def model(checkpoint):  # type: ignore[no-untyped-def]
    return hf_model(checkpoint)


def num_pages(length: int) -> int:
    return -(-length // PAGE_SIZE)


def assert_kv_matches(kv_cache, pages, hf_kv, length):  # type: ignore[no-untyped-def]
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        k, v = paged_kv(kv_cache, pages, length, layer)
        k_tol = max(TOL, K_PER_SCALE * float(hf_k.abs().max()))
        torch.testing.assert_close(k, hf_k[:length], atol=k_tol, rtol=0)
        torch.testing.assert_close(v, hf_v[:length], atol=TOL, rtol=0)


def test_layers_are_sparse_and_dense_as_configured(checkpoint):
    runner, _, _ = ours(checkpoint)
    kinds = [isinstance(layer.mlp, MoEWeights) for layer in runner.model.weights.layers]
    assert kinds == [True, False, True]
    first = runner.model.weights.layers[0].mlp
    assert first.gate_up.shape == (8, 64, 64) and first.down.shape == (8, 64, 32)


def test_chunked_prefill_beside_a_short_prompt(checkpoint, model, monkeypatch):
    monkeypatch.setattr(CausalLM, "block_tokens", 24)  # blocks cut across requests
    ids, other = prompt(300, seed=3), prompt(20, seed=4)
    runner, kv_cache, _ = ours(checkpoint)
    pages, other_pages = scattered_pages(0, num_pages(300)), scattered_pages(1, num_pages(20))
    for start in range(0, 300, 64):
        end = min(start + 64, 300)
        chunks = [chunk("long", ids, start, end, pages, last=end == 300)]
        if end == 300:
            chunks.insert(0, chunk("short", other, 0, len(other), other_pages, last=True))
        logits = runner.compute_logits(plan(*chunks))
    for row, (tokens, where) in enumerate(((other, other_pages), (ids, pages))):
        hf_logits, hf_kv = hf_forward(model, tokens)
        torch.testing.assert_close(logits[row], hf_logits[-1], atol=TOL, rtol=0)
        assert_kv_matches(kv_cache, where, hf_kv, len(tokens))


def test_batch_of_different_lengths(checkpoint, model):
    runner, kv_cache, _ = ours(checkpoint)
    prompts = [prompt(n, seed=n) for n in (5, 37, 80)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    chunks = [chunk(f"r{i}", p, 0, len(p), pages[i], last=True) for i, p in enumerate(prompts)]
    logits = runner.compute_logits(plan(*chunks))
    for i, ids in enumerate(prompts):
        hf_logits, hf_kv = hf_forward(model, ids)
        torch.testing.assert_close(logits[i], hf_logits[-1], atol=TOL, rtol=0)
        assert_kv_matches(kv_cache, pages[i], hf_kv, len(ids))


def test_tokens_spread_over_the_experts(checkpoint):
    """Routing is exercised: a 122-token batch reaches every expert of every sparse layer."""
    runner, _, _ = ours(checkpoint)
    seen: list[set[int]] = []
    experts = runner.model.experts
    real = experts.experts

    def spy(x, weights, ids, gate_up, down):  # type: ignore[no-untyped-def]
        seen.append(set(ids.unique().tolist()))
        return real(x, weights, ids, gate_up, down)

    experts.experts = spy
    ids = prompt(122, seed=5)
    runner.compute_logits(plan(chunk("a", ids, 0, 122, scattered_pages(0, 8), last=True)))
    assert len(seen) == 2 and all(len(s) == 8 for s in seen)


def test_a_wrong_routing_fails_the_comparison(checkpoint, model):
    """Guards the tests above: unnormalised top-k weights (``norm_topk_prob`` ignored) move
    the logits by far more than the tolerance."""
    ids = prompt(60, seed=6)
    hf_logits, _ = hf_forward(model, ids)
    runner, _, _ = ours(checkpoint)
    spec = runner.model.spec
    runner.model.spec = dataclasses.replace(
        spec, moe=dataclasses.replace(spec.moe, norm_topk_prob=False)
    )
    pages = scattered_pages(0, num_pages(len(ids)))
    logits = runner.compute_logits(plan(chunk("a", ids, 0, len(ids), pages, last=True)))
    assert (logits[0] - hf_logits[-1]).abs().max() > 100 * TOL


def test_cached_prefix_of_128_tokens(checkpoint, model):
    """The first 128 positions' K/V come from HF itself, written into the pages directly."""
    ids = prompt(170, seed=5)
    hf_logits, hf_kv = hf_forward(model, ids)
    runner, kv_cache, _ = ours(checkpoint)
    pages = scattered_pages(0, num_pages(len(ids)))
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        for i in range(128 // PAGE_SIZE):
            rows = slice(i * PAGE_SIZE, (i + 1) * PAGE_SIZE)
            kv_cache.k[layer][pages[i]].copy_(hf_k[rows])
            kv_cache.v[layer][pages[i]].copy_(hf_v[rows])
    logits = runner.compute_logits(plan(chunk("p", ids, 128, 170, pages, last=True)))
    torch.testing.assert_close(logits[0], hf_logits[-1], atol=TOL, rtol=0)
    assert_kv_matches(kv_cache, pages, hf_kv, len(ids))
