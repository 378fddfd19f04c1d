"""Gemma 3 (text) through our runner against ``transformers`` on a tiny random fp32
checkpoint (``tests/checkpoints.py``: layers sliding, full, sliding, sliding with a window of
24; 6 heads of 16 over 2 KV heads in a hidden of 72; the global rope linear x8 at base 1e6, the
local one at 1e4; ``query_pre_attn_scalar`` 20; every ``1 + weight`` norm randomised).

A batch of two prompts longer than the window and a prompt in three chunks: last-token
logits, prompt logprobs, every full layer's K/V at every position and every sliding layer's
over the last ``window - 1`` positions (what transformers keeps) within 1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.request import SamplingParams
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.model.conftest import ours, plan, scattered_pages
from tests.integration.model.test_gpt_oss_vs_hf import (
    TOL,
    assert_matches,
    bf16_within_hf_error,
    hf_forward,
    logprobs_of,
    num_pages,
    whole,
)

FULL = (1,)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "ckpt")


@pytest.fixture(scope="module")
def hf(checkpoint):  # type: ignore[no-untyped-def]
    return hf_model(checkpoint)


def test_a_batch_of_two_prompts(checkpoint, hf):
    runner, kv_cache, info = ours(checkpoint)
    assert (info.architecture, info.attention_backend, kv_cache.layout.num_layers) == (
        "Gemma3ForCausalLM", "sinks", 4
    )  # fmt: skip
    prompts = [prompt(100, seed=3), prompt(37, seed=4)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    out = runner.run(plan(*(whole(f"r{i}", p, pages[i]) for i, p in enumerate(prompts))))
    for i, ids in enumerate(prompts):
        logits = assert_matches(kv_cache, pages[i], ids, hf, FULL)
        assert out.sampled[i].token_id == int(logits[-1].argmax())
        got = torch.tensor(out.prompt_logprobs[i].logprobs)
        torch.testing.assert_close(got, logprobs_of(logits, ids, 0), atol=TOL, rtol=0)


def test_three_chunks_read_the_window_from_earlier_pages(checkpoint, hf):
    runner, kv_cache, _ = ours(checkpoint)
    ids = prompt(150, seed=5)
    pages = scattered_pages(0, num_pages(len(ids)))
    runner.run(plan(ChunkPlan("a", ids[:40], 0, 40, pages, None)))
    runner.run(plan(ChunkPlan("a", ids[40:90], 40, 90, pages, None)))
    last = ChunkPlan("a", ids[90:], 90, 150, pages, SamplingParams(), 90, tuple(ids[91:]))
    out = runner.run(plan(last))
    logits = assert_matches(kv_cache, pages, ids, hf, FULL)
    assert out.sampled[0].token_id == int(logits[-1].argmax())
    got = torch.tensor(out.prompt_logprobs[0].logprobs)
    torch.testing.assert_close(got, logprobs_of(logits, ids, 90), atol=TOL, rtol=0)


@pytest.mark.parametrize("change", ["no window", "one rope base", "head_dim scale"])
def test_each_part_moves_the_logits(checkpoint, hf, change):
    """The window, the local rope base and the query scale each move the last logits by
    over 20 times the tolerance, so the comparisons above check them."""
    runner, _, _ = ours(checkpoint)
    model = runner.model
    if change == "no window":
        model.sliding = dataclasses.replace(model.sliding, window=10_000)  # type: ignore[union-attr]
    elif change == "one rope base":
        model.local_rotary = model.rotary  # type: ignore[union-attr]
    else:
        model.scale = model.spec.head_dim**-0.5  # type: ignore[union-attr]
    ids = prompt(100, seed=3)
    logits, _ = hf_forward(hf, ids)
    got = runner.compute_logits(plan(whole("a", ids, scattered_pages(0, num_pages(100)))))
    assert (got[0] - logits[-1]).abs().max() > 20 * TOL


def test_softcapping_and_other_activations_are_refused():
    from prefill_worker.model.hf_config import spec_from_dict

    base = {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "sliding_window": 4,
    }  # fmt: skip
    assert spec_from_dict(base).sliding.layer_kinds == ("sliding_attention",) * 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        spec_from_dict(base | {"final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="hidden_activation 'gelu'"):
        spec_from_dict(base | {"hidden_activation": "gelu"})


def test_bf16_is_within_transformers_own_bf16_error(checkpoint, hf):
    bf16_within_hf_error(checkpoint, hf)
