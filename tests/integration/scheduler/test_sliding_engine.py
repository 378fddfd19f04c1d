"""gpt-oss through the engine with the real runner and a windowed sliding pool (``kv.sliding``):
five prompts longer than the window (24) over a sliding pool of three requests' quotas, chunks
of 8 interleaved in batches of 24 tokens (serial and overlapped forwards), one request
aborted mid-prefill. A sliding page is filled with NaN when it goes back to its pool, so a
page freed too early shows. Each finished request's first token is transformers' argmax (its
sliding layers read their window through pages the pool handed back and out again), the pool
held fewer pages than the prompts have, and afterwards both pools and the aux rows are whole
and the engine's integrity check passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import NO_PAGE, SlidingPageTable, sliding_pool_pages
from prefill_worker.model import build
from prefill_worker.request import AbortRequest, FinishReason, PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.scheduler.capture import RecordingRunner
from tests.unit.scheduler.fakes import FakeBackend

PAGE_SIZE, CHUNK, WINDOW, RUNNING = 4, 8, 24, 3
PROMPTS = {f"p{i}": prompt(n, seed=50 + i) for i, n in enumerate((45, 23, 70, 9, 31))}
ABORTED = "p2"


class PoisoningPool(PagePool):
    """The sliding pool; a page's K/V of every sliding layer become NaN when it is freed (its
    last reference dropped: a kept window's page outlives its request, ``kv.sliding``)."""

    def __init__(self, num_pages: int, kv_cache, layers: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
        super().__init__(num_pages)
        self.kv_cache, self.layers = kv_cache, layers

    def free(self, page_ids) -> None:  # type: ignore[no-untyped-def]
        page_ids = list(page_ids)
        super().free(page_ids)
        gone = [p for p in page_ids if self.refcount(p) == 0]
        for layer in self.layers:
            self.kv_cache.k[layer][gone] = float("nan")
            self.kv_cache.v[layer][gone] = float("nan")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("gpt_oss", tmp_path_factory.mktemp("swa") / "gpt_oss")


@pytest.mark.parametrize("overlap", [True])
def test_windowed_engine_matches_transformers_and_returns_every_page(
    checkpoint: Path, overlap: bool
) -> None:
    num_sliding = sliding_pool_pages(WINDOW, CHUNK, PAGE_SIZE, RUNNING)
    runner, kv_cache, info = build(
        checkpoint, dtype="float32", page_size=PAGE_SIZE, num_pages=96, sliding_pages=num_sliding
    )
    pool, aux = PagePool(96), AuxPool(8)
    sliding_pool = PoisoningPool(num_sliding, kv_cache, info.sliding_layers)
    sliding = SlidingPageTable(sliding_pool, PAGE_SIZE, WINDOW, CHUNK)
    backend = FakeBackend(pool, aux, auto_want=True, polls_to_success=1)
    recording = RecordingRunner(runner)
    outcomes = []
    limits = EngineLimits(PAGE_SIZE, CHUNK, 24, RUNNING, 60.0, 60.0)
    engine = Engine(
        recording, backend, EngineKV(pool, aux, None, sliding), outcomes.append, limits,
        overlap=overlap,
    )  # fmt: skip
    for room, (name, ids) in enumerate(PROMPTS.items(), start=1):
        engine.submit(PrefillRequest(name, ids, SamplingParams(), True, room, 0.0))
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    engine.submit(AbortRequest(ABORTED))
    for _ in range(500):
        engine.check_integrity()
        if not engine.step() and engine.load.num_live == 0:
            break
    engine.shutdown()
    engine.check_integrity()
    assert pool.num_free == pool.num_pages and aux.num_free == aux.num_rows
    assert sliding_pool.num_free == sliding_pool.num_pages
    assert num_sliding < sum(-(-len(ids) // PAGE_SIZE) for ids in PROMPTS.values())
    by_id = {o.request_id: o for o in outcomes}
    assert by_id[ABORTED].reason is FinishReason.ABORTED_BY_ROUTER
    model = hf_model(checkpoint)
    for name, ids in PROMPTS.items():
        if name == ABORTED:
            continue
        assert by_id[name].reason is FinishReason.OK, by_id[name]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        assert by_id[name].first_token_id == int(logits.argmax()), name
    last: dict[str, tuple[int, ...]] = {}  # each request's entries in its previous chunk
    for chunk in (c for plan in recording.plans for c in plan.chunks):
        first = max(0, chunk.start - WINDOW + 1) // PAGE_SIZE
        entries = tuple(chunk.sliding_page_ids)
        assert NO_PAGE not in entries[first:]  # the window held ...
        before = last.get(chunk.request_id, ())[first:]
        assert entries[first : first + len(before)] == before  # ... where it was written
        assert set(entries[: max(0, first - 2 * CHUNK // PAGE_SIZE)]) <= {NO_PAGE}
        last[chunk.request_id] = entries
