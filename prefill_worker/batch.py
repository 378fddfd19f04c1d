"""The one typed message from scheduler to model runner, and the runner's answer.

Torch-free: the scheduler builds ``BatchPlan`` from plain ints; the runner turns it into
tensors. A chunk covers prompt positions ``[start, end)``; the KV of ``[0, start)`` is already
in the request's pages, page ``i`` holding positions ``[i * page_size, (i + 1) * page_size)``.

Prompt logprobs: position ``p`` gives the logprob of token ``p + 1``, so a chunk's last
position scores the first token of the *next* chunk, which the plan therefore carries::

    prompt     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9          chunks [0, 4) [4, 8) [8, 10)
    start 2          ^ positions 2..8 score t3..t9 (position 9 samples the first token)
    chunk [0, 4):  logprob_from 2, logprob_token_ids (t3, t4)
    chunk [4, 8):  logprob_from 4, logprob_token_ids (t5, t6, t7, t8)
    chunk [8, 10): logprob_from 8, logprob_token_ids (t9,)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefill_worker.request import SamplingParams


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    request_id: str
    token_ids: Sequence[int]  # the tokens at positions [start, end), len == end - start
    start: int
    end: int
    page_ids: Sequence[int]  # the request's pages; at least ceil(end / page_size) of them
    sampling: SamplingParams | None  # set iff this chunk ends the prompt: sample token `end`
    # Positions [logprob_from, logprob_from + len(logprob_token_ids)) (within [start, end)) each
    # give the logprob of the prompt token after them, logprob_token_ids[i] for the i-th.
    logprob_from: int = 0
    logprob_token_ids: Sequence[int] = ()
    # Where the forward also writes each token's K/V, beside its page (the sender's own
    # destination: ``transfer.base.MirroringSender``); () or one slot per token.
    mirror_slots: Sequence[int] = ()
    # A hybrid model's state slot for this request: its aux row, held from admission to finish
    # (a model without state ignores it). A chunk with ``start == 0`` begins from zero
    # state, a later one from what the slot holds.
    state_slot: int | None = None
    # The prompt token at ``end`` (None when the chunk ends the prompt): a draft model's
    # input is the prompt shifted by one, so a chunk's last position reads it.
    next_token_id: int | None = None
    # A windowed sliding pool's entries (``kv.sliding``): one per prompt page up to ``end``,
    # the sliding layers' page of it or -1 where none is held (below the window); () with a
    # full pool, where the sliding layers share ``page_ids``.
    sliding_page_ids: Sequence[int] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class BatchPlan:
    batch_id: int
    chunks: tuple[ChunkPlan, ...]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


@dataclass(frozen=True, slots=True)
class DraftRow:
    """A draft model's first proposal after the prompt (``model.draft``): what an SGLang
    EAGLE/MTP decode reads as its first draft input."""

    topk_p: tuple[float, ...]  # the draft's top-k probabilities, descending
    topk_index: tuple[int, ...]  # their token ids
    hidden: bytes  # the draft's last hidden state, little-endian, in the model's dtype


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float  # log-probability of token_id under the unmodified (temperature 1) softmax
    error: str | None = None  # this row could not be sampled: its request fails, nothing else
    draft: DraftRow | None = None  # with a draft model configured


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    request_id: str
    logprobs: tuple[float, ...]  # one per logprob_token_ids entry of the request's chunk


@dataclass(frozen=True, slots=True)
class BatchOutput:
    batch_id: int
    sampled: tuple[SampledToken, ...]  # one per chunk with sampling set, in plan order
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # one per chunk with logprob_token_ids


class ModelRunner(Protocol):
    """Executes one plan. Blocking; when it returns, every chunk's K/V is in its pages."""

    def run(self, plan: BatchPlan) -> BatchOutput: ...
