"""The warm-up forward: a dummy prompt in chunks of at most ``chunk_tokens`` (at least two,
so one attends to earlier pages), only the last sampling; every page back in the pool, after
a runner failure too (``tests/integration/scheduler/test_warmup_runner.py``: a real runner)."""

from __future__ import annotations

import time

import pytest

from prefill_worker.batch import BatchOutput, BatchPlan, SampledToken
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import NO_PAGE, SlidingPageTable
from prefill_worker.scheduler.warmup import WarmUpError, warm_up


class Recorder:
    """A ``ModelRunner`` that records plans; ``fail_at`` raises, ``bad_sample`` cannot sample."""

    def __init__(self, fail_at: int | None = None, bad_sample: bool = False) -> None:
        self.plans: list[BatchPlan] = []
        self.fail_at, self.bad_sample = fail_at, bad_sample

    def run(self, plan: BatchPlan) -> BatchOutput:
        self.plans.append(plan)
        if self.fail_at == len(self.plans) - 1:
            raise RuntimeError("CUDA error: out of memory")
        sampled = tuple(
            SampledToken(c.request_id, 1, -0.5, "nan logits" if self.bad_sample else None)
            for c in plan.chunks
            if c.sampling is not None
        )
        return BatchOutput(plan.batch_id, sampled)


def test_the_prompt_goes_in_chunks_and_only_the_last_samples() -> None:
    pages, runner = PagePool(32), Recorder()
    done = warm_up(runner, pages, page_size=4, num_tokens=50, vocab_size=100, chunk_tokens=16)
    chunks = [plan.chunks[0] for plan in runner.plans]
    assert [(c.start, c.end) for c in chunks] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert [c.sampling is not None for c in chunks] == [False, False, False, True]
    assert all(len(c.page_ids) == 13 and c.page_ids == chunks[0].page_ids for c in chunks)
    assert all(0 <= t < 100 for c in chunks for t in c.token_ids)
    assert all(c.state_slot == 0 for c in chunks)  # a hybrid model's state: its first slot
    prompt = [t for c in chunks for t in c.token_ids]
    assert [c.next_token_id for c in chunks] == [prompt[16], prompt[32], prompt[48], None]
    assert done.num_tokens == 50 and done.duration_s >= 0
    assert pages.num_free == pages.num_pages


def test_a_short_prompt_still_has_two_chunks_and_a_long_one_fits_the_pool() -> None:
    pages, runner = PagePool(2), Recorder()
    warm_up(runner, pages, page_size=4, num_tokens=6, vocab_size=10, chunk_tokens=512)
    assert [(p.chunks[0].start, p.chunks[0].end) for p in runner.plans] == [(0, 3), (3, 6)]
    runner = Recorder()
    done = warm_up(runner, pages, page_size=4, num_tokens=1000, vocab_size=10, chunk_tokens=512)
    assert done.num_tokens == 8 and runner.plans[-1].chunks[0].end == 8
    assert pages.num_free == pages.num_pages


@pytest.mark.parametrize("options", [{"fail_at": 1}, {"bad_sample": True}])
def test_a_failure_is_a_warm_up_error_and_the_pages_come_back(options: dict) -> None:
    pages, runner = PagePool(16), Recorder(**options)  # fresh per run: it counts its plans
    with pytest.raises(WarmUpError, match=r"out of memory|nan logits"):
        warm_up(runner, pages, page_size=4, num_tokens=40, vocab_size=100, chunk_tokens=16)
    assert pages.num_free == pages.num_pages


def test_a_pool_already_in_use_is_refused() -> None:
    pages = PagePool(4)
    held = pages.try_alloc(3)
    assert held is not None
    with pytest.raises(WarmUpError, match="not empty"):
        warm_up(Recorder(), pages, page_size=4, num_tokens=16, vocab_size=100, chunk_tokens=8)
    assert pages.num_free == 1


def test_one_token_is_enough_and_a_chunk_limit_of_1_gives_one_chunk_per_token() -> None:
    pages, runner = PagePool(4), Recorder()
    before = time.monotonic()
    done = warm_up(runner, pages, page_size=4, num_tokens=1, vocab_size=10, chunk_tokens=8)
    assert 0 <= done.duration_s <= time.monotonic() - before
    assert done.num_tokens == 1 and len(runner.plans) == 1
    runner = Recorder()
    warm_up(runner, pages, page_size=4, num_tokens=3, vocab_size=10, chunk_tokens=1)
    assert [p.batch_id for p in runner.plans] == [0, 1, 2]
    chunks = [p.chunks[0] for p in runner.plans]
    assert [(c.start, c.end) for c in chunks] == [(0, 1), (1, 2), (2, 3)]
    assert len({c.request_id for c in chunks}) == 1 and isinstance(chunks[0].request_id, str)
    assert all(type(t) is int and 0 <= t < 10 for c in chunks for t in c.token_ids)


def test_no_token_or_a_busy_pool_is_refused_in_words() -> None:
    with pytest.raises(ValueError) as empty:
        warm_up(Recorder(), PagePool(4), page_size=4, num_tokens=0, vocab_size=10, chunk_tokens=8)
    assert str(empty.value) == "a warm-up needs at least one token and one page"
    pages = PagePool(4)
    pages.try_alloc(1)
    with pytest.raises(WarmUpError) as busy:
        warm_up(Recorder(), pages, page_size=4, num_tokens=16, vocab_size=10, chunk_tokens=8)
    assert str(busy.value) == "the KV pool is not empty before the warm-up"


@pytest.mark.parametrize("fail_at", [None, 1])
def test_a_windowed_sliding_pool_gives_each_chunk_its_window_and_takes_it_back(
    fail_at: int | None,
) -> None:
    """Window 6, pages of 4, chunks of 8: each chunk holds the sliding pages of positions
    ``[start - 5, end)``; every page returns, after a failing forward too."""
    pages, runner = PagePool(32), Recorder(fail_at=fail_at)
    sliding = SlidingPageTable(PagePool(8), 4, window=6, chunk_size=8)
    if fail_at is None:
        warm_up(runner, pages, 4, 24, 100, 8, sliding)
    else:
        with pytest.raises(WarmUpError):
            warm_up(runner, pages, 4, 24, 100, 8, sliding)
    entries = [plan.chunks[0].sliding_page_ids for plan in runner.plans]
    held = [[i for i, p in enumerate(e) if p != NO_PAGE] for e in entries]
    assert held[:2] == [[0, 1], [0, 1, 2, 3]]  # [0, 8), then [3, 16): pages 0..3
    if fail_at is None:
        assert held[2] == [2, 3, 4, 5]  # [11, 24): pages 2..5 (0 and 1 went back)
    assert sliding.pool.num_free == sliding.pool.num_pages and not sliding.num_available_pages < 8
    assert pages.num_free == pages.num_pages
    sliding.check_integrity()


def test_a_sliding_pool_already_in_use_fails_the_warm_up_and_keeps_the_kv_pool_whole() -> None:
    pages, runner = PagePool(32), Recorder()
    sliding = SlidingPageTable(PagePool(8), 4, window=6, chunk_size=8)
    assert sliding.try_reserve("other", 40)
    assert sliding.try_reserve("another", 40) is False  # its quota (8 pages) holds the pool
    with pytest.raises(WarmUpError, match="sliding pool is not empty"):
        warm_up(runner, pages, 4, 24, 100, 8, sliding)
    assert not runner.plans and pages.num_free == pages.num_pages
