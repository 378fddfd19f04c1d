"""DeepSeek-V3.2 and GLM-5 (MLA + the DSA indexer) through our runner against ``transformers``.

Tiny random checkpoints saved by transformers (``tests/checkpoints.py``: an indexer of 6 heads
of 24 choosing the top 12 keys; DeepSeek-V3.2 with YaRN and half-split index rope, GLM-5 with
interleaved index rope and its layer 2 reusing layer 1's choice). Prompts of 29 to 75 tokens,
so most queries attend to 12 of their keys. fp32: the sampled token, its logprob, the prompt
logprobs, every layer's MLA pool rows and every indexed layer's index keys equal
transformers' (its ``indexer_keys``; GLM-5's roped part in our in-place interleaved order),
for a batch of two prompts, a prompt in three chunks, and a prefix hit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.hf_config import CheckpointError
from prefill_worker.request import SamplingParams
from prefill_worker.service.checkmodel import check_model
from prefill_worker.service.config import load_config
from tests.checkpoints import DSA_FAMILIES, make_checkpoint
from tests.integration.daemon.conftest import ROOT
from tests.integration.model.conftest import (
    PAGE_SIZE,
    hf_index_keys,
    hf_mla_forward,
    hf_model,
    ours,
    plan,
    prompt,
    scattered_pages,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=DSA_FAMILIES)
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


@pytest.fixture(scope="module")
def hf(checkpoint):  # type: ignore[no-untyped-def]
    return hf_model(checkpoint)


def num_pages(length: int) -> int:
    return -(-length // PAGE_SIZE)


def whole(request_id: str, ids: list[int], pages: list[int]) -> ChunkPlan:
    return ChunkPlan(request_id, ids, 0, len(ids), pages, SamplingParams(), 0, tuple(ids[1:]))


def prompt_logprobs(logits: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    return logits[start:-1].log_softmax(-1).gather(1, torch.tensor(ids[start + 1 :])[:, None])[:, 0]


def assert_caches_match(runner, kv_cache, hf, ids: list[int], pages: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Every layer's MLA pool rows and every indexed layer's index keys of ``ids``."""
    _, rows = hf_mla_forward(hf, ids)
    length = len(ids)
    for layer, expected in enumerate(rows):
        got = torch.cat([kv_cache.k[layer][p] for p in pages])[:length, 0]
        torch.testing.assert_close(got, expected, atol=TOL, rtol=1e-5)
    index_cache = runner.model.index_cache
    expected_keys = hf_index_keys(hf, ids)
    assert tuple(expected_keys) == index_cache.spec.indexed_layers
    for layer, expected in expected_keys.items():
        got = index_cache.read(layer, pages, length)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=1e-5)


def test_a_batch_of_two_prompts(checkpoint, hf):
    runner, kv_cache, info = ours(checkpoint)
    assert info.attention_backend == "sdpa_dsa"
    prompts = [prompt(70, seed=3), prompt(29, seed=4)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    out = runner.run(plan(*(whole(f"r{i}", p, pages[i]) for i, p in enumerate(prompts))))
    for i, ids in enumerate(prompts):
        logits, _ = hf_mla_forward(hf, ids)
        assert out.sampled[i].token_id == int(logits[-1].argmax())
        expected_logprob = float(logits[-1].log_softmax(-1).max())
        assert out.sampled[i].logprob == pytest.approx(expected_logprob, abs=TOL)
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs[i].logprobs),
            prompt_logprobs(logits, ids, 0),
            atol=TOL,
            rtol=0,
        )
        assert_caches_match(runner, kv_cache, hf, ids, pages[i])


def test_three_chunks_then_a_prefix_hit(checkpoint, hf):
    """Chunks [0, 32), [32, 48), [48, 75): the later ones choose among index keys read back
    from the pages; then a prompt sharing the first 3 pages computes only its own tokens."""
    runner, kv_cache, _ = ours(checkpoint)
    a = prompt(75, seed=5)
    pages_a = scattered_pages(0, num_pages(len(a)))
    for start, end in ((0, 32), (32, 48)):
        runner.run(plan(ChunkPlan("a", a[start:end], start, end, pages_a, None)))
    last = ChunkPlan("a", a[48:], 48, 75, pages_a, SamplingParams())
    logits_a = runner.compute_logits(plan(last))
    hf_logits_a, _ = hf_mla_forward(hf, a)
    torch.testing.assert_close(logits_a[0], hf_logits_a[-1], atol=TOL, rtol=0)
    assert_caches_match(runner, kv_cache, hf, a, pages_a)

    cached = 3 * PAGE_SIZE
    b = a[:cached] + prompt(22, seed=6)
    pages_b = pages_a[:3] + scattered_pages(1, num_pages(len(b)) - 3)
    logits_b = runner.compute_logits(
        plan(ChunkPlan("b", b[cached:], cached, len(b), pages_b, SamplingParams()))
    )
    hf_logits_b, _ = hf_mla_forward(hf, b)
    torch.testing.assert_close(logits_b[0], hf_logits_b[-1], atol=TOL, rtol=0)
    assert_caches_match(runner, kv_cache, hf, b, pages_b)


def test_the_indexer_choice_moves_the_logits(checkpoint, hf):
    """The same run attending to every key (top-k past the prompt) is far from transformers':
    the comparisons above depend on the choice."""
    runner, _, _ = ours(checkpoint)
    runner.model.indexer = dataclasses.replace(runner.model.indexer, topk=10**6)
    ids = prompt(70, seed=3)
    out = runner.run(plan(whole("a", ids, scattered_pages(0, num_pages(len(ids))))))
    logits, _ = hf_mla_forward(hf, ids)
    dense = torch.tensor(out.prompt_logprobs[0].logprobs)
    assert (dense - prompt_logprobs(logits, ids, 0)).abs().max() > 100 * TOL


def test_an_mtp_draft_is_refused(checkpoint):
    """Its MTP layer has an indexer of its own, which the DeepSeek-V3 draft does not run."""
    with pytest.raises(ValueError, match="draft 'mtp' needs a DeepSeek-V3 model, not"):
        build(checkpoint, "float32", "cpu", page_size=16, num_pages=8, draft="mtp")


def test_without_a_low_rank_q_it_is_refused(tmp_path: Path):
    path = make_checkpoint("deepseek_v32", tmp_path / "ckpt")
    config = (path / "config.json").read_text().replace('"q_lora_rank": 48', '"q_lora_rank": null')
    (path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="q_lora_rank is missing"):
        ours(path)


def test_the_index_cache_shares_the_kv_budget_as_check_config_counts_it(checkpoint):
    """A page costs its MLA rows and its index keys (fp32: 3 layers × 40 + 3 × 24 values a
    token for DeepSeek-V3.2, 3 × 40 + 2 × 24 for GLM-5): the pool built from a byte budget
    and check-config's arithmetic agree on the page count."""
    budget = 1_000_000
    runner, kv_cache, _ = build(checkpoint, "float32", "cpu", page_size=16, memory_bytes=budget)
    indexed = len(runner.model.index_cache.spec.indexed_layers)
    per_page = 16 * 4 * (3 * 40 + indexed * 24)
    assert kv_cache.layout.num_pages == budget // per_page
    assert runner.model.index_cache.keys[0].shape == (budget // per_page, 16, 24)
    overrides = [f"model.path={checkpoint}", "cache.page_size=16", "cache.num_pages=null"]
    overrides.append(f"cache.memory_bytes={budget}")
    config = load_config(ROOT / "configs" / "tiny-test.yaml", env={}, overrides=overrides)
    notes = check_model(config).notes
    assert f"= {budget // per_page} pages" in " ".join(notes)
    assert any(n.startswith(f"index cache (DSA): {indexed} indexed layers") for n in notes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_indexer_head_weights_have_transformers_dtype(checkpoint, dtype):
    """transformers keeps ``indexer.weights_proj`` in fp32 in an fp16 model
    (``_keep_in_fp32_modules``) and in bf16 in a bf16 one, and projects in that dtype: ours
    are its values and dtype exactly (fp16: not rounded through fp16)."""
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    runner, _, _ = build(checkpoint, name, "cpu", page_size=16, num_pages=8)
    theirs = hf_model(checkpoint, dtype)
    for layer in runner.model.indexer.indexed_layers:
        want = theirs.model.layers[layer].self_attn.indexer.weights_proj.weight
        got = runner.model.indexers[layer].weights_proj
        assert got.dtype == want.dtype == (torch.float32 if dtype == torch.float16 else dtype)
        assert torch.equal(got, want)
        assert torch.equal(got, want.to(dtype)) == (dtype == torch.bfloat16)


def test_an_fp8_pool_is_refused_for_what_it_is(checkpoint):
    """The DSA attention is the family's own: the refusal points at cache.kv_dtype, not at an
    attention backend that would change nothing."""
    with pytest.raises(ValueError, match=r"set cache\.kv_dtype auto") as refused:
        build(checkpoint, "float32", "cpu", page_size=16, num_pages=8, kv_dtype="fp8_e4m3")
    assert "sdpa_dsa" in str(refused.value)
    assert "model.attention_backend sdpa" not in str(refused.value)
