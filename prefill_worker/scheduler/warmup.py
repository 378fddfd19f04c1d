"""The warm-up forward: one dummy prompt through the runner before the worker says it is ready.

The first forward of a process pays for what the ones after it do not: flashinfer compiles
its kernels on first use (minutes on a fresh GPU host), CUDA and the caching allocator set up,
CPU kernels pick their paths. Paid by the first real request instead, it lands on a request
whose decode peer and router are waiting, past their deadlines. So the daemon runs
``warm_up`` after loading the model and before readiness: a prompt of ``num_tokens`` dummy
tokens in at least two chunks of at most ``chunk_tokens`` (later ones attend to the pages of
earlier ones, as a chunked prompt's do), the last one sampling a token, in pages taken from
the pool and given back whatever happens.
Torch-free: it drives the ``ModelRunner`` seam, like the engine.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from prefill_worker.batch import BatchPlan, ChunkPlan, ModelRunner
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import SlidingPageTable
from prefill_worker.request import SamplingParams

_REQUEST_ID = "warm-up"
_GREEDY = SamplingParams()


class WarmUpError(RuntimeError):
    """The warm-up forward failed: the model cannot serve (the daemon does not start)."""


@dataclass(frozen=True, slots=True)
class WarmUp:
    num_tokens: int
    duration_s: float


def warm_up(
    runner: ModelRunner,
    pages: PagePool,
    page_size: int,
    num_tokens: int,
    vocab_size: int,
    chunk_tokens: int,
    sliding: SlidingPageTable | None = None,
) -> WarmUp:
    """Run the warm-up prompt (``num_tokens`` >= 1, at most what the pool holds); every page
    goes back to ``pages``. Raises ``WarmUpError`` with the runner's error."""
    num_tokens = min(num_tokens, pages.num_pages * page_size)
    if num_tokens < 1:
        raise ValueError("a warm-up needs at least one token and one page")
    page_ids = pages.try_alloc(-(-num_tokens // page_size))
    if page_ids is None:
        raise WarmUpError("the KV pool is not empty before the warm-up")
    token_ids = [(7 + 31 * i) % vocab_size for i in range(num_tokens)]  # any ids will do
    step = max(1, min(chunk_tokens, -(-num_tokens // 2)))
    bounds = [*range(0, num_tokens, step), num_tokens]
    started = time.monotonic()
    # a windowed sliding pool: its pages per chunk, as the engine's
    if sliding is not None and not sliding.try_reserve(_REQUEST_ID, num_tokens):
        pages.free(page_ids)
        raise WarmUpError("the sliding pool is not empty before the warm-up")
    try:
        for batch_id, (start, end) in enumerate(itertools.pairwise(bounds)):
            last = end == num_tokens
            chunk = ChunkPlan(
                _REQUEST_ID,
                token_ids[start:end],
                start,
                end,
                page_ids,
                _GREEDY if last else None,
                state_slot=0,  # before any request: a hybrid model's first slot is free
                next_token_id=None if last else token_ids[end],
                sliding_page_ids=_sliding_pages(sliding, start, end),
            )
            output = runner.run(BatchPlan(batch_id, (chunk,)))
            if sliding is not None:
                sliding.chunk_done(_REQUEST_ID, end)
            errors = [s.error for s in output.sampled if s.error is not None]
            if errors:
                raise WarmUpError(f"the warm-up could not sample: {errors[0]}")
    except WarmUpError:
        raise
    except Exception as exc:  # the runner's own failure: the model cannot serve
        raise WarmUpError(f"the warm-up forward failed: {exc!r}") from exc
    finally:
        pages.free(page_ids)
        if sliding is not None:
            sliding.release(_REQUEST_ID)
    return WarmUp(num_tokens, time.monotonic() - started)


def _sliding_pages(sliding: SlidingPageTable | None, start: int, end: int) -> tuple[int, ...]:
    return () if sliding is None else sliding.pages_for(_REQUEST_ID, start, end)
