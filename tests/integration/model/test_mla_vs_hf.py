"""DeepSeek-V3 (MLA attention, DeepSeek MoE) through our runner against ``transformers``.

Tiny random checkpoints saved by transformers (``tests/checkpoints.py``: YaRN with both
mscales, q and the roped key scaled up, 16 experts with a load-balancing bias that changes
choices), with and without a low-rank q. fp32: the sampled token, its logprob, the prompt
logprobs and every layer's pool rows equal transformers' (its cache holds the normalised
latent as ``keys`` and the roped key part as ``values``; ours holds the roped part in
SGLang's interleaved order, a fixed permutation of transformers'), for a batch of two
prompts, a prompt in two chunks, and a prefix hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.kv.layout import MLA
from prefill_worker.model.moe.block import MoEWeights
from prefill_worker.request import SamplingParams
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import (
    PAGE_SIZE,
    hf_mla_forward,
    hf_model,
    ours,
    plan,
    prompt,
    scattered_pages,
)

TOL = 1e-4
RANK, ROPE = 32, 8  # kv_lora_rank, qk_rope_head_dim of the checkpoint


@pytest.fixture(scope="module", params=["q_lora", "no_q_lora"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    overrides = {"q_lora_rank": None} if request.param == "no_q_lora" else {}
    root = tmp_path_factory.mktemp(request.param)
    return make_checkpoint("deepseek_v3", root / "ckpt", **overrides)


@pytest.fixture(scope="module")
def hf(checkpoint):  # type: ignore[no-untyped-def]
    return hf_model(checkpoint)


def pool_rows(kv_cache, pages: list[int], length: int, layer: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat([kv_cache.k[layer][p] for p in pages])[:length, 0]


def assert_pool_matches(kv_cache, pages, hf_rows, length):  # type: ignore[no-untyped-def]
    for layer, expected in enumerate(hf_rows):
        got = pool_rows(kv_cache, pages, length, layer)
        torch.testing.assert_close(got, expected[:length], atol=TOL, rtol=1e-5)


def num_pages(length: int) -> int:
    return -(-length // PAGE_SIZE)


def whole(request_id: str, ids: list[int], pages: list[int]) -> ChunkPlan:
    """The whole prompt, sampled greedily, with the logprob of every prompt token after
    the first."""
    return ChunkPlan(
        request_id, ids, 0, len(ids), pages, SamplingParams(), 0, tuple(ids[1:])
    )  # fmt: skip


def prompt_logprobs(logits: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    """transformers' logprob of each prompt token after ``start``."""
    return logits[start:-1].log_softmax(-1).gather(1, torch.tensor(ids[start + 1 :])[:, None])[:, 0]


def test_a_batch_of_two_prompts(checkpoint, hf):
    runner, kv_cache, info = ours(checkpoint)
    assert (kv_cache.layout.kind, info.head_dim, kv_cache.v_base_addrs) == (MLA, RANK + ROPE, ())
    prompts = [prompt(100, seed=3), prompt(37, seed=4)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    out = runner.run(plan(*(whole(f"r{i}", p, pages[i]) for i, p in enumerate(prompts))))
    for i, ids in enumerate(prompts):
        logits, rows = hf_mla_forward(hf, ids)
        sampled, logprobs = out.sampled[i], out.prompt_logprobs[i]
        assert sampled.token_id == int(logits[-1].argmax())
        assert sampled.logprob == pytest.approx(float(logits[-1].log_softmax(-1).max()), abs=TOL)
        torch.testing.assert_close(
            torch.tensor(logprobs.logprobs), prompt_logprobs(logits, ids, 0), atol=TOL, rtol=0
        )
        assert_pool_matches(kv_cache, pages[i], rows, len(ids))


def test_two_chunks_then_a_prefix_hit(checkpoint, hf):
    """A prompt in two chunks (the second reads the first's latents back from the pool);
    then a second prompt that shares its first 4 pages computes only its own tokens."""
    runner, kv_cache, _ = ours(checkpoint)
    a = prompt(90, seed=5)
    pages_a = scattered_pages(0, num_pages(len(a)))
    runner.run(plan(ChunkPlan("a", a[:40], 0, 40, pages_a, None)))
    last = ChunkPlan("a", a[40:], 40, 90, pages_a, SamplingParams(), 40, tuple(a[41:]))
    out = runner.run(plan(last))
    logits, rows = hf_mla_forward(hf, a)
    assert out.sampled[0].token_id == int(logits[-1].argmax())
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs[0].logprobs),
        prompt_logprobs(logits, a, 40),
        atol=TOL,
        rtol=0,
    )
    assert_pool_matches(kv_cache, pages_a, rows, len(a))

    cached = 4 * PAGE_SIZE
    b = a[:cached] + prompt(30, seed=6)
    pages_b = pages_a[:4] + scattered_pages(1, num_pages(len(b)) - 4)
    logits_b = runner.compute_logits(
        plan(ChunkPlan("b", b[cached:], cached, len(b), pages_b, SamplingParams()))
    )
    hf_logits_b, rows_b = hf_mla_forward(hf, b)
    torch.testing.assert_close(logits_b[0], hf_logits_b[-1], atol=TOL, rtol=0)
    assert_pool_matches(kv_cache, pages_b, rows_b, len(b))


def test_tokens_spread_over_the_experts_and_the_bias_decides(checkpoint, hf):
    """The routing the comparisons above exercise: most experts chosen, and the same run
    without the load-balancing bias moves the prompt logprobs far beyond the tolerance."""
    ids = prompt(100, seed=3)
    chosen: list[int] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out: chosen.append(out[2].unique().numel())
        )
        for layer in hf.model.layers[1:]  # the sparse ones
    ]
    logits, _ = hf_mla_forward(hf, ids)
    for hook in hooks:
        hook.remove()
    assert len(chosen) == 2 and min(chosen) >= 11  # of 16
    runner, _, _ = ours(checkpoint)
    pages = scattered_pages(0, num_pages(len(ids)))
    for layer in runner.model.weights.layers:
        if isinstance(layer.mlp, MoEWeights) and layer.mlp.score_bias is not None:
            layer.mlp.score_bias.zero_()
    out = runner.run(plan(whole("a", ids, pages)))
    unbiased = torch.tensor(out.prompt_logprobs[0].logprobs)
    assert (unbiased - prompt_logprobs(logits, ids, 0)).abs().max() > 100 * TOL


def test_a_k_v_pool_layout_is_refused(checkpoint):
    with pytest.raises(ValueError, match="'page_major' does not apply to an MLA model"):
        ours(checkpoint, pool_layout="page_major")
