"""Greedy agreement between our runner and a reference model, forgiving near-ties only.

Two greedy decodes of one model in different arithmetic (bf16 against fp32, or one CPU's
kernels against another's) part ways where the reference's top two logits are nearly equal:
neither is wrong, and a check that compares strings fails on a coin toss. A broken model (a
permuted projection, a RoPE slip) parts ways on wide margins. So: run the candidate's tokens
through the reference with teacher forcing (one forward); where the reference would have
chosen another token, measure its margin (its own choice's logit minus the candidate's).
Within the dtype's tolerance it is a near-tie and that prompt's comparison ends there (the
sequences differ from then on); beyond it, the candidate fails::

    step        0     1     2     3
    candidate  The  capital  of   France ...     each token fed to the reference in turn
    reference  The  capital  of   Paris          margin 7.3 > tolerance: failure
               L                                 margin 0.10 <= tolerance: near-tie, stop

Used by ``scripts/prepare_model.py`` (the conversion check) and the demo's test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import Runner
from prefill_worker.request import SamplingParams

# How far (in logits) the reference's choice may lead the candidate's for a divergence to be
# a near-tie. fp32 against fp32 differs by ~1e-4; transformers' own bf16 forward differs from
# its fp32 one by up to 0.8 on SmolLM2's demo prompts.
TIE_TOLERANCE = {"float32": 0.05, "float16": 1.0, "bfloat16": 1.0}

# token ids [T] -> fp32 logits [T, vocab]; row t is the prediction for position t + 1
AllLogits = Callable[[Sequence[int]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Divergence:
    prompt_index: int
    step: int  # index of the generated token where the two choices differ
    reference_token: int
    candidate_token: int
    margin: float  # reference logit of its choice minus that of the candidate's

    def __str__(self) -> str:
        return (
            f"prompt {self.prompt_index} step {self.step}: reference {self.reference_token},"
            f" candidate {self.candidate_token}, margin {self.margin:.4f}"
        )


@dataclass(frozen=True, slots=True)
class Agreement:
    num_tokens_equal: int
    near_ties: tuple[Divergence, ...]
    failures: tuple[Divergence, ...]

    @property
    def is_ok(self) -> bool:
        return not self.failures


def compare_greedy(
    reference: AllLogits,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[Sequence[int]],
    tolerance: float,
) -> Agreement:
    """Check each candidate continuation against the reference's greedy choices."""
    equal = 0
    ties: list[Divergence] = []
    failures: list[Divergence] = []
    for index, (prompt, tokens) in enumerate(zip(prompts, candidates, strict=True)):
        found = _first_divergence(reference, index, prompt, tokens)
        if found is None:
            equal += len(tokens)
            continue
        equal += found.step
        (ties if found.margin <= tolerance else failures).append(found)
    return Agreement(equal, tuple(ties), tuple(failures))


def _first_divergence(
    reference: AllLogits, index: int, prompt: Sequence[int], tokens: Sequence[int]
) -> Divergence | None:
    if not tokens:
        return None
    logits = reference([*prompt, *tokens])[len(prompt) - 1 :]  # row i predicts tokens[i]
    for step, token in enumerate(tokens):
        choice = int(logits[step].argmax())
        if choice != token:
            margin = float(logits[step, choice] - logits[step, token])
            return Divergence(index, step, choice, token, margin)
    return None


def hf_logits(model: torch.nn.Module) -> AllLogits:
    """A transformers causal LM as the reference: one forward, fp32 logits of every position."""

    def all_logits(ids: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids)))
        return out.logits[0].float()

    return all_logits


def runner_greedy(
    runner: Runner,
    prompt: Sequence[int],
    num_tokens: int,
    page_size: int,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """Our runner's greedy continuation: one prefill, then one-token chunks over the pages.

    Uses pages ``0 .. ceil((len(prompt) + num_tokens) / page_size)`` of the runner's pool."""
    ids = list(prompt)
    pages = list(range(-(-(len(ids) + num_tokens) // page_size)))
    start, generated = 0, []
    for _ in range(num_tokens):
        chunk = ChunkPlan("greedy", ids[start:], start, len(ids), pages, SamplingParams())
        token = runner.run(BatchPlan(0, (chunk,))).sampled[0].token_id
        generated.append(token)
        if token in stop_token_ids:
            break
        start = len(ids)
        ids.append(token)
    return generated
