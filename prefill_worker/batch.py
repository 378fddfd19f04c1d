"""The one typed message from scheduler to model runner, and the runner's answer.

Torch-free: the scheduler builds ``BatchPlan`` from plain ints; the runner turns it into
tensors. A chunk covers prompt positions ``[start, end)`` of one request; the KV of positions
``[0, start)`` is already in that request's pages. Page ``i`` of ``page_ids`` holds positions
``[i * page_size, (i + 1) * page_size)``::

    positions  0 ........ start ========= end ....... len(prompt)
    pages      [p0][p1][p2][p3][p4]            (page_ids covers at least [0, end))
                         ^ this chunk's K/V is written here
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
class SampledToken:
    request_id: str
    token_id: int
    logprob: float  # log-probability of token_id under the unmodified (temperature 1) softmax
    error: str | None = None  # this row could not be sampled: its request fails, nothing else


@dataclass(frozen=True, slots=True)
class BatchOutput:
    batch_id: int
    sampled: tuple[SampledToken, ...]  # one per chunk with sampling set, in plan order


class ModelRunner(Protocol):
    """Executes one plan. Blocking; when it returns, every chunk's K/V is in its pages."""

    def run(self, plan: BatchPlan) -> BatchOutput: ...
