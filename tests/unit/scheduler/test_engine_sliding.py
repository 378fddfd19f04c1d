"""The engine with a windowed sliding pool (``kv.sliding``), around a fake runner that also
writes each chunk's tokens into its sliding entries and reads the window back from them: a
page freed too early (cleared when it goes back) or an entry planned for the wrong positions
shows as a wrong window. Both pools are whole afterwards, on finish and on abort. An aborted
request's sliding pages, as its full pages, stay allocated while a forward of it is in flight
(``PageTable.detach``), so even that chunk finds its window (with overlapped forwards, freeing
them at the abort lost window positions 3-7 of "b")."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prefill_worker.batch import BatchOutput, BatchPlan
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import NO_PAGE, SlidingPageTable, sliding_pool_pages
from prefill_worker.request import AbortRequest, FinishReason, PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from tests.unit.scheduler.fakes import FakeBackend, FakeRunner

PS, WINDOW, CHUNK = 4, 6, 8


class ClearingPool(PagePool):
    """The sliding pool: a page's tokens are forgotten when it goes back."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.kv: list[list[int | None]] = [[None] * PS for _ in range(num_pages)]

    def free(self, page_ids) -> None:  # type: ignore[no-untyped-def]
        page_ids = list(page_ids)
        for page_id in page_ids:
            self.kv[page_id] = [None] * PS
        super().free(page_ids)


class SlidingRunner(FakeRunner):
    """Also writes each chunk into its sliding entries after checking its window there."""

    def __init__(self, pool: PagePool, sliding: ClearingPool) -> None:
        super().__init__(pool, PS)
        self.sliding = sliding

    def run(self, plan: BatchPlan) -> BatchOutput:
        for chunk in plan.chunks:
            entries, prompt = chunk.sliding_page_ids, self.prompts[chunk.request_id]
            for pos in range(max(0, chunk.start - WINDOW + 1), chunk.start):
                if self._read(entries, pos) != prompt[pos]:
                    self.errors.append(f"{chunk.request_id}: window position {pos} lost")
            for pos in range(chunk.start, chunk.end):
                page_id = entries[pos // PS]
                if page_id == NO_PAGE or self.sliding.refcount(page_id) != 1:
                    self.errors.append(f"{chunk.request_id}: no sliding page for {pos}")
                else:
                    self.sliding.kv[page_id][pos % PS] = prompt[pos]
        return super().run(plan)

    def _read(self, entries: Sequence[int], pos: int) -> int | None:
        page_id = entries[pos // PS]
        return None if page_id == NO_PAGE else self.sliding.kv[page_id][pos % PS]


@pytest.mark.parametrize("overlap", [False, True])
def test_windows_survive_chunks_and_every_sliding_page_returns(overlap: bool) -> None:
    pool, aux = PagePool(64), AuxPool(8)
    sliding_pool = ClearingPool(sliding_pool_pages(WINDOW, CHUNK, PS, 2))
    sliding = SlidingPageTable(sliding_pool, PS, WINDOW, CHUNK)
    runner = SlidingRunner(pool, sliding_pool)
    backend = FakeBackend(pool, aux, auto_want=True, polls_to_success=1)
    outcomes: list = []
    limits = EngineLimits(PS, CHUNK, 16, 2, 60.0, 60.0)
    engine = Engine(
        runner, backend, EngineKV(pool, aux, None, sliding), outcomes.append, limits,
        overlap=overlap,
    )  # fmt: skip
    lengths = {"a": 37, "b": 22, "c": 41, "d": 30}
    for room, (name, n) in enumerate(lengths.items(), start=1):
        ids = [(room * 131 + 7 * i) % 1000 for i in range(n)]
        runner.prompts[name] = ids
        engine.submit(PrefillRequest(name, ids, SamplingParams(), True, room, 0.0))
    engine.step()
    engine.step()
    engine.submit(AbortRequest("b"))
    for _ in range(200):
        engine.check_integrity()
        if not engine.step() and engine.load.num_live == 0:
            break
    engine.shutdown()
    engine.check_integrity()
    assert not runner.errors, runner.errors
    by_id = {o.request_id: o.reason for o in outcomes}
    assert by_id == {"a": FinishReason.OK, "b": FinishReason.ABORTED_BY_ROUTER,
                     "c": FinishReason.OK, "d": FinishReason.OK}  # fmt: skip
    assert pool.num_free == pool.num_pages and aux.num_free == aux.num_rows
    for name in ("a", "c", "d"):  # each send named the sliding pages of its window
        sender, n = backend.senders[name], lengths[name]
        first_window_page = max(0, n - WINDOW + 1) // PS
        for (page_ids, first), entries in zip(sender.sent, sender.sliding_sent, strict=True):
            assert len(entries) == len(page_ids), name
            kept = [e for i, e in enumerate(entries) if first + i >= first_window_page]
            assert all(e != NO_PAGE for e in kept), (name, first, entries)
    assert sliding_pool.num_free == sliding_pool.num_pages
    assert sliding.num_available_pages == sliding_pool.num_pages
    entries = [c.sliding_page_ids for p in runner.plans for c in p.chunks]
    assert all(len(e) == -(-c.end // PS) for e, c in
               zip(entries, [c for p in runner.plans for c in p.chunks], strict=True))  # fmt: skip
    assert any(NO_PAGE in e for e in entries)  # early pages did go back mid-prompt
