"""Prefix hits with a windowed sliding pool (``kv.sliding``, docs/prefix-cache.md "A windowed
sliding pool"), through the engine with the real runner against ``transformers``: gpt-oss and
Gemma 3 (tiny, fp32, window 24). A 45-token prompt runs first; its chain (11 pages, 44 tokens)
is cached and its window (the sliding pages of positions [21, 44)) kept. A 64-token prompt
sharing those 44 tokens then hits all 44: its first chunk starts there and its sliding layers
read positions [21, 44) from the kept pages, which no request writes. Its first token, that
token's logprob and its prompt logprobs equal transformers' within 1e-4 and its hit is
reported; a prompt sharing 30 tokens (7 cached pages, no window kept at 28) hits nothing. A
sliding page is NaN-filled when it goes back to its pool, so a window freed too early shows.
Afterwards the pools hold only the cache's pages and kept windows; a reset (every chain
evicted) frees the kept window pages too, and the engine's integrity check passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import NO_PAGE, SlidingPageTable, sliding_pool_pages
from prefill_worker.model import build
from prefill_worker.request import PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.scheduler.capture import RecordingRunner
from tests.integration.scheduler.test_sliding_engine import PoisoningPool
from tests.unit.scheduler.fakes import FakeBackend

PAGE_SIZE, CHUNK, WINDOW, RUNNING, TOL = 4, 8, 24, 3, 1e-4
FIRST = prompt(45, seed=70)
HIT = 44  # the first prompt's whole pages
SECOND = [*FIRST[:HIT], *prompt(20, seed=71)]
THIRD = [*FIRST[:30], *prompt(9, seed=72)]


@pytest.fixture(scope="module", params=["gpt_oss", "gemma3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(request.param, tmp_path_factory.mktemp("swa_hit") / request.param)


def run(engine: Engine, requests: list[PrefillRequest]) -> None:
    for req in requests:
        engine.submit(req)
    for _ in range(500):
        engine.check_integrity()
        if not engine.step() and engine.load.num_live == 0:
            return
    raise AssertionError("the engine did not finish")


def test_a_prefix_hit_reads_the_kept_window_and_matches_transformers(checkpoint: Path) -> None:
    num_sliding = sliding_pool_pages(WINDOW, CHUNK, PAGE_SIZE, RUNNING)
    runner, kv_cache, info = build(
        checkpoint, dtype="float32", page_size=PAGE_SIZE, num_pages=96, sliding_pages=num_sliding
    )
    pool, aux = PagePool(96), AuxPool(8)
    cache = PagePrefixCache(pool, PAGE_SIZE)
    sliding_pool = PoisoningPool(num_sliding, kv_cache, info.sliding_layers)
    sliding = SlidingPageTable(sliding_pool, PAGE_SIZE, WINDOW, CHUNK)
    backend = FakeBackend(pool, aux, auto_want=True, polls_to_success=1)
    recording = RecordingRunner(runner)
    outcomes = []
    limits = EngineLimits(PAGE_SIZE, CHUNK, 24, RUNNING, 60.0, 60.0)
    engine = Engine(
        recording, backend, EngineKV(pool, aux, cache, sliding), outcomes.append, limits,
        overlap=True,
    )  # fmt: skip
    run(engine, [PrefillRequest("first", FIRST, SamplingParams(), False, 1, 0.0)])
    assert len(sliding.window_keys()) == 1
    first = sliding.window_first(HIT // PAGE_SIZE)  # page 5: positions [20, 44) kept
    kept = {p for p in range(num_sliding) if sliding_pool.refcount(p)}
    assert len(kept) == HIT // PAGE_SIZE - first == 6
    run(engine, [
        PrefillRequest("second", SECOND, SamplingParams(), True, 2, 0.0, prompt_logprob_start=HIT),
        PrefillRequest("third", THIRD, SamplingParams(), False, 3, 0.0),
    ])  # fmt: skip
    # only the cache's pages and the kept windows (one per prompt's chain) are left
    assert pool.num_used == cache.num_pages and aux.num_free == aux.num_rows
    assert len(sliding.window_keys()) == 3
    # 6 pages each; second's ([41, 64): pages 10-15) shares page 10 with first's (5-10)
    assert sliding_pool.num_used == sliding.num_kept_pages == 3 * len(kept) - 1
    engine.shutdown()  # resets the cache: every chain evicted frees its window's pages too
    assert pool.num_free == pool.num_pages and sliding_pool.num_free == sliding_pool.num_pages
    assert sliding.window_keys() == ()
    engine.check_integrity()
    by_id = {o.request_id: o for o in outcomes}
    assert [by_id[r].num_prefix_hit_tokens for r in ("first", "second", "third")] == [0, HIT, 0]
    chunks = [c for plan in recording.plans for c in plan.chunks if c.request_id == "second"]
    assert chunks[0].start == HIT
    assert set(chunks[0].sliding_page_ids[first : HIT // PAGE_SIZE]) == kept
    assert set(chunks[0].sliding_page_ids[:first]) <= {NO_PAGE}
    model = hf_model(checkpoint)
    for name, ids in (("first", FIRST), ("second", SECOND), ("third", THIRD)):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        assert by_id[name].first_token_id == int(logits[-1].argmax()), name
        if name != "second":
            continue
        logprobs = logits.log_softmax(-1)
        assert by_id[name].first_token_logprob == pytest.approx(float(logprobs[-1].max()), abs=TOL)
        want = logprobs[HIT:-1].gather(1, torch.tensor(ids[HIT + 1 :])[:, None])[:, 0]
        got = torch.tensor(by_id[name].prompt_logprobs)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
