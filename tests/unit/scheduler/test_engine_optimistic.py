"""Optimistic prefill with a scripted decode (fake runner and sender): the want before, during
and after the prefill; a held prefill yielding on its hold bound and coming back as a cache
hit; attempts running out; an abort in each new state; page pressure making a held prefill
yield. Every run ends with one outcome per request, the pools whole, and no page sent to a
room before its decode claimed it (``FakeSender`` records a send before the want as an error).
"""

from __future__ import annotations

import threading

import pytest

from prefill_worker.request import FinishReason, RequestState
from tests.unit.scheduler.fakes import Rig, expected_token, fake_logprob, make_rig

PS = 4


def optimistic_rig(**kw: object) -> Rig:
    options: dict = dict(
        page_size=PS,
        chunk_size=8,
        max_batch_tokens=16,
        num_pages=32,
        auto_want=False,
        optimistic=True,
        prefix_cache=True,
        optimistic_hold_s=1.0,
    )
    options.update(kw)
    return make_rig(**options)


def chunks_of(rig: Rig, request_id: str) -> list[tuple[int, int]]:
    return [
        (c.start, c.end) for p in rig.runner.plans for c in p.chunks if c.request_id == request_id
    ]


def state_of(rig: Rig, request_id: str) -> RequestState | None:
    req = rig.engine._life.queues.live.get(request_id)
    return None if req is None else req.state


def is_held(rig: Rig, request_id: str) -> bool:
    req = rig.engine._life.queues.live.get(request_id)
    return req is not None and req.held_at is not None


def check_ok(rig: Rig, request_id: str, *, hit: int = 0, retries: int = 0) -> None:
    out, msg = rig.outcome(request_id), rig.messages[request_id]
    n = len(msg.token_ids)
    assert out.reason is FinishReason.OK, out
    assert out.first_token_id == expected_token(msg.token_ids)
    assert rig.sender(request_id).prompt_pages_sent() == list(range(-(-n // PS)))  # once each
    assert (out.num_prefix_hit_tokens, out.num_computed_tokens) == (hit, n - hit)
    assert out.prefill_retries == retries


def test_want_before_the_prefill_is_the_usual_path() -> None:
    rig = optimistic_rig()
    rig.prefill("a", 20)
    rig.sender("a").want()
    rig.run_until_idle()
    check_ok(rig, "a")
    rig.check_whole()


def test_want_during_the_prefill_pushes_what_is_computed_then_the_rest() -> None:
    rig = optimistic_rig()
    rig.prefill("a", 30)  # 4 chunks of 8
    rig.steps(3)  # a serial forward runs when it is collected, a turn after its launch
    assert chunks_of(rig, "a")[:2] == [(0, 8), (8, 16)]  # computed before any want
    assert rig.sender("a").sent == []
    rig.sender("a").want()
    rig.steps(1)
    assert rig.sender("a").prompt_pages_sent()[:4] == [0, 1, 2, 3]  # pages of the 16 tokens
    rig.run_until_idle()
    check_ok(rig, "a")
    rig.check_whole()


def test_want_after_the_prefill_pushes_the_held_request_at_once() -> None:
    rig = optimistic_rig()
    rig.prefill("a", 14)
    rig.steps(3)
    assert chunks_of(rig, "a") == [(0, 8), (8, 14)]
    assert state_of(rig, "a") is RequestState.PREFILLING and rig.sender("a").sent == []
    assert rig.engine.load.num_free_aux_rows == rig.aux.num_rows - 1  # held: row and pages kept
    rig.clock.advance(0.5)  # within the hold bound
    rig.sender("a").want()
    rig.run_until_idle()
    rig.clock.advance(1.0)
    rig.steps(1)  # its hold's deadline passes: it no longer applies
    assert len(rig.runner.plans) == 2  # nothing computed again
    check_ok(rig, "a")
    rig.check_whole()


def test_a_held_prefill_yields_after_its_bound_and_returns_as_a_cache_hit() -> None:
    rig = optimistic_rig()
    rig.prefill("a", 14)  # 3 full pages and a partial one
    rig.steps(3)
    rig.clock.advance(0.5)
    rig.steps(1)
    assert rig.engine.load.num_cached_pages == 3 and rig.engine.load.num_free_aux_rows < 8
    rig.clock.advance(0.5)  # the hold bound passes: it yields and is admitted again
    rig.steps(1)
    assert rig.engine.load.num_cached_pages == 3  # its full pages stayed in the prefix cache
    rig.steps(2)
    assert chunks_of(rig, "a")[2:] == [(12, 14)]  # the second attempt computes the last page
    rig.sender("a").want()
    rig.run_until_idle()
    check_ok(rig, "a", hit=12, retries=1)
    rig.check_whole()


def test_a_retry_reports_its_prompt_logprobs_once() -> None:
    rig = optimistic_rig()
    msg = rig.prefill("a", 14, prompt_logprob_start=5)
    rig.steps(3)
    rig.clock.advance(1.0)
    rig.steps(3)
    rig.sender("a").want()
    rig.run_until_idle()
    check_ok(rig, "a", hit=4, retries=1)  # the hit stops at the logprob start's page
    tokens = msg.token_ids
    assert rig.outcome("a").prompt_logprobs == tuple(
        fake_logprob(p, tokens[p + 1]) for p in range(5, 13)
    )
    rig.check_whole()


@pytest.mark.parametrize("attempts", [1, 2])
def test_after_the_attempts_it_waits_for_its_want_as_before(attempts: int) -> None:
    rig = optimistic_rig(optimistic_attempts=attempts)
    rig.prefill("a", 14)
    for _ in range(attempts):
        rig.steps(3)
        rig.clock.advance(1.0)
    rig.steps(5)
    assert state_of(rig, "a") is RequestState.BOOTSTRAPPING
    assert len(chunks_of(rig, "a")) == 1 + attempts  # not admitted again without its want
    rig.sender("a").want()
    rig.run_until_idle()
    check_ok(rig, "a", hit=12, retries=attempts)
    rig.check_whole()


def test_the_bootstrap_timeout_still_ends_a_held_prefill() -> None:
    rig = optimistic_rig(bootstrap_timeout_s=2.0, optimistic_hold_s=5.0)
    rig.prefill("a", 14)
    rig.steps(3)
    rig.clock.advance(2.0)
    rig.run_until_idle()
    assert rig.outcome("a").reason is FinishReason.BOOTSTRAP_TIMEOUT
    assert rig.sender("a").sent == [] and rig.sender("a").failure_reason() is not None
    rig.check_whole()


@pytest.mark.parametrize("where", ["prefilling", "in_forward", "held", "yielded"])
def test_an_abort_in_each_new_state_leaves_the_pools_whole(where: str) -> None:
    rig = optimistic_rig(overlap=where == "in_forward", optimistic_attempts=1)
    rig.prefill("a", 30)
    if where == "prefilling":
        rig.steps(2)
    elif where == "in_forward":
        rig.runner.gate = threading.Event()
        rig.steps(1)  # the first chunk is launched and waits in the forward
        assert rig.runner.started.wait(10)
    else:
        rig.steps(5)  # done: held
        if where == "yielded":
            rig.clock.advance(1.0)
            rig.steps(1)
            assert state_of(rig, "a") is RequestState.BOOTSTRAPPING
    rig.abort("a")
    if rig.runner.gate is not None:
        rig.runner.gate.set()
    rig.run_until_idle()
    out = rig.outcome("a")
    assert out.reason is FinishReason.ABORTED_BY_ROUTER and rig.sender("a").sent == []
    if where == "yielded":  # nothing of the yielded attempt is reported
        assert (out.num_prefix_hit_tokens, out.num_computed_tokens) == (0, 0)
        assert out.prefill_retries == 1
    rig.engine.shutdown()
    rig.check_whole()


def test_page_pressure_makes_a_held_prefill_yield() -> None:
    rig = optimistic_rig(num_pages=8)
    rig.prefill("held", 20)  # 5 pages
    rig.steps(4)
    assert is_held(rig, "held")
    rig.clock.advance(0.5)
    rig.prefill("claimed", 16)  # 4 pages: only there if the held one yields
    rig.sender("claimed").want()
    rig.steps(1)
    assert state_of(rig, "held") is RequestState.BOOTSTRAPPING
    assert state_of(rig, "claimed") is RequestState.PREFILLING  # admitted in the same turn
    rig.steps(20)
    check_ok(rig, "claimed")
    # its second prefill would need pages the claimed request left in the cache: speculative
    # work evicts none of them (#40 finding 5), so it waits for its want
    assert state_of(rig, "held") is RequestState.BOOTSTRAPPING
    rig.sender("held").want()
    rig.run_until_idle()
    check_ok(rig, "held", hit=16, retries=1)  # its own pages, cached by its first prefill
    rig.check_whole()


def test_a_push_that_raises_at_the_claim_fails_only_its_request() -> None:
    rig = optimistic_rig()
    rig.prefill("a", 14)
    rig.prefill("b", 14)
    rig.steps(4)
    rig.sender("a").send_raises = RuntimeError("bad pages")
    rig.sender("a").want()
    rig.sender("b").want()
    rig.run_until_idle()
    assert rig.outcome("a").reason is FinishReason.ENGINE_ERROR
    assert "bad pages" in (rig.outcome("a").error or "")
    check_ok(rig, "b")
    rig.check_whole()


def test_off_by_default_nothing_is_prefilled_before_the_want() -> None:
    rig = optimistic_rig(optimistic=False)
    rig.prefill("a", 14)
    rig.steps(3)
    assert chunks_of(rig, "a") == []
    rig.sender("a").want()
    rig.run_until_idle()
    check_ok(rig, "a")
    rig.check_whole()
