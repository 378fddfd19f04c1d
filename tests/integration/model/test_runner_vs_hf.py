"""Our paged, packed, chunked prefill against ``transformers`` on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.model.layers import Rotary
from prefill_worker.model.llama import CausalLM
from prefill_worker.request import SamplingParams
from tests.integration.model.conftest import (
    FAMILIES,
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
POOL_LAYOUTS = pytest.mark.parametrize("pool_layout", ["layer_major", "page_major", "vllm_blocks"])


def num_pages(length: int) -> int:
    return -(-length // PAGE_SIZE)


def assert_kv_matches(kv_cache, pages, hf_kv, length):  # type: ignore[no-untyped-def]
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        k, v = paged_kv(kv_cache, pages, length, layer)
        torch.testing.assert_close(k, hf_k[:length], atol=TOL, rtol=0)
        torch.testing.assert_close(v, hf_v[:length], atol=TOL, rtol=0)


@POOL_LAYOUTS
@pytest.mark.parametrize("family", FAMILIES)
def test_one_prompt(checkpoints, family, pool_layout):
    ids = prompt(45, seed=1)
    hf_logits, hf_kv = hf_forward(hf_model(checkpoints[family]), ids)
    runner, kv_cache, info = ours(checkpoints[family], pool_layout=pool_layout)
    pages = scattered_pages(0, num_pages(len(ids)))
    logits = runner.compute_logits(plan(chunk("a", ids, 0, len(ids), pages, last=True)))
    assert logits.shape == (1, info.vocab_size)
    torch.testing.assert_close(logits[0], hf_logits[-1], atol=TOL, rtol=0)
    assert_kv_matches(kv_cache, pages, hf_kv, len(ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_different_lengths(checkpoints, family, monkeypatch):
    monkeypatch.setattr(CausalLM, "block_tokens", 24)  # blocks cut across requests
    model = hf_model(checkpoints[family])
    runner, kv_cache, _ = ours(checkpoints[family])
    prompts = [prompt(n, seed=n) for n in (5, 37, 80)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    chunks = [chunk(f"r{i}", p, 0, len(p), pages[i], last=True) for i, p in enumerate(prompts)]
    logits = runner.compute_logits(plan(*chunks))
    for i, ids in enumerate(prompts):
        hf_logits, hf_kv = hf_forward(model, ids)
        torch.testing.assert_close(logits[i], hf_logits[-1], atol=TOL, rtol=0)
        assert_kv_matches(kv_cache, pages[i], hf_kv, len(ids))


@POOL_LAYOUTS
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_over_300_tokens(checkpoints, family, pool_layout):
    ids = prompt(300, seed=3)
    hf_logits, hf_kv = hf_forward(hf_model(checkpoints[family]), ids)
    runner, kv_cache, _ = ours(checkpoints[family], pool_layout=pool_layout)
    pages = scattered_pages(0, num_pages(len(ids)))
    other = prompt(20, seed=4)  # a second request shares the last batch
    other_pages = scattered_pages(1, num_pages(len(other)))
    for start in range(0, 300, 64):
        end = min(start + 64, 300)
        chunks = [chunk("long", ids, start, end, pages, last=end == 300)]
        if end == 300:
            chunks.insert(0, chunk("short", other, 0, len(other), other_pages, last=True))
        logits = runner.compute_logits(plan(*chunks))
    torch.testing.assert_close(logits[1], hf_logits[-1], atol=TOL, rtol=0)
    assert_kv_matches(kv_cache, pages, hf_kv, len(ids))


@POOL_LAYOUTS
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prefix_of_128_tokens(checkpoints, family, pool_layout):
    """The first 128 positions' K/V come from HF itself, written into the pages directly."""
    ids = prompt(170, seed=5)
    hf_logits, hf_kv = hf_forward(hf_model(checkpoints[family]), ids)
    runner, kv_cache, _ = ours(checkpoints[family], pool_layout=pool_layout)
    pages = scattered_pages(0, num_pages(len(ids)))
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        for i in range(128 // PAGE_SIZE):
            rows = slice(i * PAGE_SIZE, (i + 1) * PAGE_SIZE)
            kv_cache.k[layer][pages[i]].copy_(hf_k[rows])
            kv_cache.v[layer][pages[i]].copy_(hf_v[rows])
    logits = runner.compute_logits(plan(chunk("p", ids, 128, 170, pages, last=True)))
    torch.testing.assert_close(logits[0], hf_logits[-1], atol=TOL, rtol=0)
    assert_kv_matches(kv_cache, pages, hf_kv, len(ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_top1_agrees(checkpoints, family):
    """Top-1 agrees with HF in bf16 wherever the fp32 model has a clear winner (a near tie
    may flip under one bf16 rounding either way)."""
    hf32, hf16 = hf_model(checkpoints[family]), hf_model(checkpoints[family], torch.bfloat16)
    runner, _, _ = ours(checkpoints[family], dtype="bfloat16")
    prompts = [prompt(n, seed=10 + n) for n in (9, 21, 33, 47, 70, 90)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    chunks = [chunk(f"r{i}", p, 0, len(p), pages[i], last=True) for i, p in enumerate(prompts)]
    logits = runner.compute_logits(plan(*chunks))
    assert logits.dtype == torch.bfloat16
    num_clear = 0
    for i, ids in enumerate(prompts):
        top2 = hf_forward(hf32, ids)[0][-1].topk(2).values
        hf16_logits = hf_forward(hf16, ids)[0][-1]
        torch.testing.assert_close(logits[i].float(), hf16_logits, atol=0.1, rtol=0)
        if top2[0] - top2[1] < 0.03:  # bf16 moves these logits by ~0.01
            continue
        num_clear += 1
        assert int(logits[i].argmax()) == int(hf16_logits.argmax())
    assert num_clear >= 3


def test_without_rope_the_comparison_fails(checkpoints, monkeypatch):
    """Guards the tests above: they can tell a model that ignores positions."""
    ids = prompt(60, seed=6)
    hf_logits, _ = hf_forward(hf_model(checkpoints["llama"]), ids)
    monkeypatch.setattr(Rotary, "apply_into", lambda self, x, cos, sin, out: out.copy_(x))
    runner, _, _ = ours(checkpoints["llama"])
    pages = scattered_pages(0, num_pages(len(ids)))
    logits = runner.compute_logits(plan(chunk("a", ids, 0, len(ids), pages, last=True)))
    assert (logits[0] - hf_logits[-1]).abs().max() > 100 * TOL


def test_run_samples_only_completed_prompts(checkpoints):
    runner, _, _ = ours(checkpoints["qwen3"])
    a, b = prompt(40, seed=7), prompt(30, seed=8)
    out = runner.run(
        plan(
            chunk("a", a, 0, 32, scattered_pages(0, 2), last=False),
            chunk("b", b, 0, 30, scattered_pages(1, 2), last=True),
        )
    )
    assert [s.request_id for s in out.sampled] == ["b"]
    logits = runner.compute_logits(plan(chunk("b", b, 0, 30, scattered_pages(1, 2), last=True)))
    assert out.sampled[0].token_id == int(logits[0].argmax())
    assert out.sampled[0].logprob == pytest.approx(float(logits[0].log_softmax(-1).max()), abs=1e-5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    again = [
        runner.run(plan(ChunkPlan("b", b[16:], 16, 30, scattered_pages(1, 2), seeded)))
        for _ in range(2)
    ]
    assert again[0] == again[1]


def test_bad_chunks_are_refused(checkpoints):
    runner, _, info = ours(checkpoints["llama"])
    ids = prompt(40, seed=9)
    with pytest.raises(ValueError, match="3 pages needed"):
        runner.run(plan(chunk("a", ids, 0, 40, scattered_pages(0, 2), last=True)))
    bad = [*ids[:-1], info.vocab_size]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.run(plan(chunk("a", bad, 0, 40, scattered_pages(0, 3), last=True)))
    assert runner.run(plan()).sampled == ()


def test_fp16_is_close_to_fp32(checkpoints):
    ids = prompt(50, seed=12)
    hf_logits, _ = hf_forward(hf_model(checkpoints["qwen2"]), ids)
    runner, kv_cache, info = ours(checkpoints["qwen2"], dtype="float16")
    assert info.dtype == "float16" and kv_cache.k[0].dtype == torch.float16
    pages = scattered_pages(0, num_pages(len(ids)))
    logits = runner.compute_logits(plan(chunk("a", ids, 0, len(ids), pages, last=True)))
    torch.testing.assert_close(logits[0].float(), hf_logits[-1], atol=2e-2, rtol=0)
