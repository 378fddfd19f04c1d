"""The preparation check (``prefill_worker.testing.greedy``) forgives near-ties, nothing else.

Two checkpoints made on purpose: one where a bf16 forward provably picks another first token
than fp32 on a near-tie (the check must pass), and one whose attention Q/K rows are permuted
as a GGUF converter that forgot to undo llama.cpp's permutation would leave them (it must fail).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefill_worker.model import build
from prefill_worker.testing.greedy import (
    TIE_TOLERANCE,
    compare_greedy,
    hf_logits,
    runner_greedy,
)
from tests.checkpoints import COMMON, hf_model, make_checkpoint, prompt

NUM_TOKENS = 16
PAGE_SIZE = 4
PROMPTS = [prompt(n, seed=n) for n in (5, 11, 23)]


def greedy(path: Path, dtype: str) -> list[list[int]]:
    longest = max(len(p) for p in PROMPTS) + NUM_TOKENS
    runner, _, _ = build(path, dtype, "cpu", "sdpa", PAGE_SIZE, -(-longest // PAGE_SIZE))
    return [runner_greedy(runner, ids, NUM_TOKENS, PAGE_SIZE) for ids in PROMPTS]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("greedy") / "llama")


def test_our_fp32_agrees_with_transformers_token_for_token(original: Path) -> None:
    agreement = compare_greedy(
        hf_logits(hf_model(original)), PROMPTS, greedy(original, "float32"), 0.0
    )
    assert agreement.is_ok and not agreement.near_ties, agreement
    assert agreement.num_tokens_equal == NUM_TOKENS * len(PROMPTS)


def near_tie_checkpoint(original: Path, out: Path) -> tuple[int, int]:
    """Copy ``original`` with lm_head row B a hair above row A, where A is the fp32 first token
    of PROMPTS[0] and B > A. In fp32 B wins by ~2e-4 of A's logit; in bf16 the two rows round
    to the same values, the logits tie exactly, and argmax takes the lower id, A."""
    logits = hf_logits(hf_model(original))(PROMPTS[0])[-1]
    a = int(logits.argmax())
    assert logits[a] > 0 and a < COMMON["vocab_size"] - 1
    b = a + 1
    weights = load_file(original / "model.safetensors")
    head = weights["lm_head.weight"].clone()
    head[a] = (head[a] * 3).bfloat16().float()  # exactly representable in bf16; A leads clearly
    head[b] = head[a] * (1 + 2**-12)  # within half a bf16 ulp: rounds back to row A
    weights["lm_head.weight"] = head
    save_with_weights(original, out, weights)
    return a, b


def save_with_weights(original: Path, out: Path, weights: dict[str, torch.Tensor]) -> None:
    """``original``'s checkpoint at ``out``, with ``weights`` in place of its tensors."""
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        (out / name).write_bytes((original / name).read_bytes())
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def test_passes_when_bf16_flips_a_near_tie(original: Path, tmp_path: Path) -> None:
    tied = tmp_path / "tied"
    a, b = near_tie_checkpoint(original, tied)
    reference = hf_logits(hf_model(tied))
    candidates = greedy(tied, "bfloat16")
    assert int(reference(PROMPTS[0])[-1].argmax()) == b  # fp32 says B...
    assert candidates[0][0] == a  # ...our bf16 says A: the greedy continuations differ
    strict = compare_greedy(reference, PROMPTS, candidates, tolerance=0.0)
    assert not strict.is_ok  # a check that compares tokens exactly would fail here
    agreement = compare_greedy(reference, PROMPTS, candidates, TIE_TOLERANCE["bfloat16"])
    assert agreement.is_ok, agreement.failures
    assert any(tie.prompt_index == 0 and tie.step == 0 for tie in agreement.near_ties)


def permute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (rotary halves interleaved), which HF checkpoints undo."""
    rows, cols = w.shape
    return w.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def test_fails_for_a_conversion_that_leaves_q_and_k_permuted(
    original: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    weights = load_file(original / "model.safetensors")
    for name in list(weights):
        if name.endswith("q_proj.weight"):
            weights[name] = permute_rows(weights[name], COMMON["num_attention_heads"])
        if name.endswith("k_proj.weight"):
            weights[name] = permute_rows(weights[name], COMMON["num_key_value_heads"])
    save_with_weights(original, broken, weights)
    reference = hf_logits(hf_model(original))  # the source, as the GGUF reader sees it
    candidates = greedy(broken, "float32")
    agreement = compare_greedy(reference, PROMPTS, candidates, TIE_TOLERANCE["float32"])
    assert not agreement.is_ok, agreement.near_ties
