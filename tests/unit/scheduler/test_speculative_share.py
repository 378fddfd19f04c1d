"""Speculative work (optimistic prefill before a decode claims the request) is bounded and
comes after claimed work (#40 finding 5): claimed requests are admitted ahead of a flood of
unclaimed ones and their forwards carry no speculative chunk; the flood takes at most
``optimistic_share`` of a forward's tokens, of the running requests and of the pages; and it
evicts no prefix-cache page a claimed request left (the cache's trusted pages), so a legit
user's prefix keeps hitting."""

from __future__ import annotations

from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.tables import PageTable
from prefill_worker.request import FinishReason, RequestState
from tests.unit.scheduler.fakes import Rig, make_rig

PS = 4


def flood_rig(**kw: object) -> Rig:
    options: dict = dict(
        page_size=PS,
        chunk_size=8,
        max_batch_tokens=32,
        max_running_requests=8,
        num_pages=64,
        num_aux_rows=16,
        auto_want=False,
        optimistic=True,
        prefix_cache=True,
        optimistic_share=0.25,
        bootstrap_timeout_s=600.0,
    )
    options.update(kw)
    return make_rig(**options)


def cached_table(num_pages: int, max_pages: int | None = None) -> PageTable:
    """A page table over a pool of ``num_pages`` and a prefix cache (at most ``max_pages``):
    ``table.pool``, ``table.cache``."""
    pool = PagePool(num_pages)
    return PageTable(pool, PS, PagePrefixCache(pool, PS, max_pages))


def live(rig: Rig, request_id: str):  # type: ignore[no-untyped-def]
    return rig.engine._life.queues.live.get(request_id)


def speculative_chunks(rig: Rig, plan_index: int) -> list[int]:
    plan = rig.runner.plans[plan_index]
    claimed = {c.request_id for c in plan.chunks if c.request_id.startswith("legit")}
    return [c.num_tokens for c in plan.chunks if c.request_id not in claimed]


def test_a_flood_takes_its_share_of_each_forward_and_of_the_running_requests() -> None:
    rig = flood_rig()
    for i in range(40):
        rig.prefill(f"idle{i}", 16)
    rig.steps(6)
    assert rig.runner.plans
    for index in range(len(rig.runner.plans)):
        assert sum(speculative_chunks(rig, index)) <= 32 // 4  # a quarter of each forward
    queues = rig.engine._life.queues
    computing = [r for r in queues.prefilling.values() if r.held_at is None]
    assert len(computing) <= 8 // 4  # a quarter of max_running_requests


def test_a_flood_holds_at_most_its_share_of_the_pages() -> None:
    rig = flood_rig(optimistic_hold_s=600.0)  # finished ones hold their pages
    for i in range(40):
        rig.prefill(f"idle{i}", 16)  # 4 pages each
    rig.steps(60)
    held = rig.engine._life._table.num_speculative_pages()
    assert 0 < held <= 64 // 4 + 4  # the share, and the one admitted at its edge


def test_a_claimed_request_is_admitted_ahead_of_the_flood() -> None:
    rig = flood_rig()
    for i in range(40):
        rig.prefill(f"idle{i}", 16)
    rig.steps(3)
    rig.prefill("legit", 16)
    rig.sender("legit").want()
    rig.steps(2)  # claim seen, admitted in the next batch: not behind 40 unclaimed
    assert live(rig, "legit").state in (RequestState.PREFILLING, RequestState.TRANSFERRING)
    for _ in range(20):
        rig.steps(1)
        if rig.outcomes:
            break
    assert [o.request_id for o in rig.outcomes] == ["legit"]
    assert rig.outcomes[0].reason is FinishReason.OK
    with_legit = [p for p in rig.runner.plans if any(c.request_id == "legit" for c in p.chunks)]
    assert with_legit and all(len(p.chunks) == 1 for p in with_legit)  # no speculative beside it


def test_a_flood_evicts_no_page_a_claimed_prefix_left() -> None:
    rig = flood_rig(num_pages=32, optimistic_share=1.0)  # the share aside: the cache's rule
    prefix = list(range(1000, 1016))  # 4 full pages
    rig.prefill("legit0", 17, token_ids=[*prefix, 7])
    rig.sender("legit0").want()
    rig.run_until_idle()
    for i in range(30):  # 8 pages each: far more than the pool
        rig.prefill(f"idle{i}", 32)
    rig.steps(80)
    rig.prefill("legit1", 17, token_ids=[*prefix, 8])
    rig.sender("legit1").want()
    for _ in range(80):
        rig.steps(1)
        if any(o.request_id == "legit1" for o in rig.outcomes):
            break
    out = rig.outcome("legit1")
    assert out.reason is FinishReason.OK
    assert out.num_prefix_hit_tokens == 16  # before: 0, its prefix evicted by the flood


def test_speculative_eviction_takes_only_untrusted_idle_pages() -> None:
    table = cached_table(6)
    trusted_prompt, spec_prompt = [*list(range(8)), 99], [*list(range(100, 108)), 99]
    assert table.try_reserve("claimed", trusted_prompt) is not None  # 3 pages
    table.commit("claimed", 8)
    table.release("claimed")  # 2 cached pages, trusted
    assert table.try_reserve("spec", spec_prompt, speculative=True) is not None  # 3 pages
    table.commit("spec", 8)
    table.release("spec")  # 2 cached pages, untrusted
    assert table.cache.num_evictable == 4 and table.pool.num_free == 2
    # speculative work needing 5 pages may evict only the 2 untrusted ones: refused, untouched
    assert table.try_reserve("spec2", list(range(200, 220)), speculative=True) is None
    assert table.cache.num_evictable == 4
    assert table.try_reserve("spec3", list(range(300, 316)), speculative=True) is not None
    assert table.lookup(trusted_prompt).num_tokens == 8  # the trusted prefix survived
    assert table.lookup(spec_prompt).num_tokens == 0
    table.release("spec3")
    table.cache.check_integrity()
    # a claimed request evicts least recently used first, trusted or not
    assert table.try_reserve("claimed2", list(range(400, 424))) is not None
    assert table.lookup(trusted_prompt).num_tokens == 0
    table.release("claimed2")
    table.check_integrity()


def test_a_claim_makes_a_speculative_requests_pages_trusted() -> None:
    table = cached_table(4)
    prompt = [*list(range(8)), 99]
    assert table.try_reserve("r", prompt, speculative=True) is not None
    table.claim("r")
    table.commit("r", 8)
    table.release("r")
    assert table.num_speculative_pages() == 0
    assert table.try_reserve("spec", list(range(100, 116)), speculative=True) is None
    assert table.lookup(prompt).num_tokens == 8
    table.check_integrity()


def test_a_speculative_store_at_the_cap_evicts_only_untrusted_pages() -> None:
    table = cached_table(8, max_pages=2)
    trusted_prompt = [*range(8), 99]
    assert table.try_reserve("claimed", trusted_prompt) is not None
    table.commit("claimed", 8)
    table.release("claimed")  # the cache is at its cap: 2 trusted idle pages
    spec_prompt = [*range(100, 108), 99]
    assert table.try_reserve("spec", spec_prompt, speculative=True) is not None
    table.commit("spec", 8)  # at the cap, nothing untrusted to evict: not stored
    assert table.lookup(spec_prompt).num_tokens == 0
    assert table.lookup(trusted_prompt).num_tokens == 8
    table.release("spec")
    assert table.try_reserve("claimed2", spec_prompt) is not None
    table.commit("claimed2", 8)  # a claimed store evicts the trusted pages
    assert table.lookup(spec_prompt).num_tokens == 8
    assert table.lookup(trusted_prompt).num_tokens == 0
    table.release("claimed2")
    table.check_integrity()


def test_detached_pages_come_back_as_trusted_as_their_request() -> None:
    table = cached_table(4)
    spec_prompt = [*range(8), 99]
    assert table.try_reserve("spec", spec_prompt, speculative=True) is not None
    table.commit("spec", 8)
    table.free_detached(table.detach("spec"), trusted=False)  # an ended speculative request
    assert table.try_reserve("spec2", list(range(100, 116)), speculative=True) is not None
    assert table.lookup(spec_prompt).num_tokens == 0  # its pages were evictable by speculation
    table.release("spec2")
    claimed_prompt = [*range(200, 208), 99]
    assert table.try_reserve("claimed", claimed_prompt) is not None
    table.commit("claimed", 8)
    table.free_detached(table.detach("claimed"))  # trusted by default
    assert table.try_reserve("spec3", list(range(300, 316)), speculative=True) is None
    assert table.lookup(claimed_prompt).num_tokens == 8
    table.check_integrity()


def test_a_speculative_request_ended_mid_forward_leaves_its_pages_untrusted() -> None:
    rig = flood_rig(overlap=True, optimistic_share=1.0)
    rig.prefill("spec", 16, token_ids=list(range(500, 516)))  # 4 pages, 2 chunks of 8
    for _ in range(10):
        rig.steps(1)
        req = live(rig, "spec")
        if req is not None and req.is_in_forward and req.num_scheduled_tokens == 16:
            break
    rig.abort("spec")  # its pages are freed once the forward is collected
    rig.run_until_idle()
    cache = rig.engine._table.cache
    assert isinstance(cache, PagePrefixCache)
    assert cache.num_evictable > 0
    assert list(cache._untrusted) == list(cache._idle)  # nothing of it is trusted
    rig.check_whole()


def test_the_engine_forgets_a_claim_once_its_request_moves_on() -> None:
    rig = flood_rig(optimistic=False)
    rig.prefill("legit", 8)
    rig.steps(1)
    rig.sender("legit").want()
    rig.run_until_idle()
    assert rig.outcome("legit").reason is FinishReason.OK
    assert not rig.engine._life._claimed  # no ended request kept for a claim


def _computing(rig: Rig) -> list[str]:
    queues = rig.engine._life.queues
    return [r.request_id for r in queues.prefilling.values() if r.held_at is None]


def test_the_running_share_counts_computing_requests_not_held_ones() -> None:
    rig = flood_rig(
        max_running_requests=4, optimistic_share=0.5, max_batch_tokens=64, optimistic_hold_s=600
    )  # two speculative requests compute at once
    for i in range(10):
        rig.prefill(f"idle{i}", 32)  # 4 chunks each
    most = 0
    for _ in range(60):
        rig.steps(1)
        most = max(most, len(_computing(rig)))
        assert len(_computing(rig)) <= 2
    assert most == 2
    assert len(rig.engine._life.queues.held) >= 4  # the held ones did not count


def test_the_shares_are_at_least_one_request_and_one_page() -> None:
    rig = flood_rig(max_running_requests=2, max_batch_tokens=64, optimistic_hold_s=600)  # 1
    for i in range(4):
        rig.prefill(f"idle{i}", 32)  # 4 chunks each
    for _ in range(20):
        rig.steps(1)
        assert len(_computing(rig)) <= 1
    rig = flood_rig(num_pages=3, optimistic_hold_s=600)  # 3 x 0.25 pages: one page
    for i in range(4):
        rig.prefill(f"idle{i}", 4)  # one page each
    rig.steps(20)
    assert rig.engine._life._table.num_speculative_pages() == 1  # one held, no second


def test_the_page_share_stops_speculative_work_at_its_edge() -> None:
    rig = flood_rig(optimistic_hold_s=600)  # 64 pages: 16 speculative
    for i in range(10):
        rig.prefill(f"idle{i}", 16)  # 4 pages each
    rig.steps(80)
    assert rig.engine._life._table.num_speculative_pages() == 16


def test_a_yield_counts_its_request_back_among_the_bootstrapping() -> None:
    rig = flood_rig(optimistic_hold_s=0.5)
    for i in range(6):
        rig.prefill(f"idle{i}", 8)
    rig.steps(10)  # some finished and held, the rest still bootstrapping
    rig.clock.advance(1.0)
    rig.steps(1)  # the held ones yield: back to BOOTSTRAPPING beside the others
    assert rig.engine.load.num_bootstrapping + rig.engine.load.num_prefilling == 6
    rig.engine.check_integrity()


def test_a_hit_on_untrusted_pages_takes_them_out_of_speculative_reach() -> None:
    table = cached_table(4)
    prompt = [*range(8), 99]
    assert table.try_reserve("spec", prompt, speculative=True) is not None
    table.commit("spec", 8)
    table.release("spec")  # 2 untrusted idle pages
    hit = table.lookup(prompt)
    assert table.try_reserve("claimed", prompt, hit) is not None  # uses them now
    table.cache.check_integrity()
    assert table.try_reserve("spec2", list(range(100, 108)), speculative=True) is None
    assert table.lookup(prompt).num_tokens == 8  # in use: no speculative eviction took them
    table.release("claimed")
    table.check_integrity()
