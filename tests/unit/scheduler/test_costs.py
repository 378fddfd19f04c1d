"""The cost signals: the estimator (``scheduler.costs``), the prediction built on them
(``load.CostSignals``, ``ttft_slo_refusal``) and what the engine publishes, on a scripted
clock whose forwards cost a set time per token."""

from __future__ import annotations

import pytest

from prefill_worker.load import TTFT_SLO_REJECT, CostSignals, ttft_slo_refusal
from prefill_worker.request import (
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
    Timings,
)
from prefill_worker.scheduler.costs import (
    SAMPLE_MAX_AGE_S,
    ArrivalRate,
    CostEstimator,
    ForwardCost,
    fit_forward_cost,
)
from prefill_worker.scheduler.tracked import Request
from tests.clocks import FakeClock
from tests.unit.scheduler.fakes import Rig, make_rig


def _outcome(
    bootstrap_s: float, transfer_s: float, ok: bool = True, num_computed: int = 10
) -> Outcome:
    status = OutcomeStatus.OK if ok else OutcomeStatus.FAILED
    reason = FinishReason.OK if ok else FinishReason.TRANSFER_FAILED
    timings = Timings(bootstrap_s=bootstrap_s, transfer_s=transfer_s)
    return Outcome("r", status, reason, 10, timings=timings, num_computed_tokens=num_computed)


def _request(num_tokens: int, num_computed: int) -> Request:
    msg = PrefillRequest("r", list(range(num_tokens)), SamplingParams(), False, 1, 0.0)
    req = Request(msg, None)
    req.num_computed_tokens = num_computed
    return req


# ---- the estimator ----------------------------------------------------------------------


def test_a_new_estimator_reports_no_rate_and_no_overheads() -> None:
    signals = CostEstimator().signals(0, [], None)
    assert signals == CostSignals(0, 0, None, 0.0, 0.0)


def test_running_tokens_are_what_prefilling_requests_have_left() -> None:
    prefilling = [_request(100, 40), _request(30, 0), _request(8, 8)]
    signals = CostEstimator().signals(500, prefilling, ForwardCost(0.0, 0.01))
    assert signals.queued_tokens == 500
    assert signals.running_tokens == 60 + 30 + 0
    assert signals.prefill_rate_tps == pytest.approx(100.0)


def test_a_zero_seconds_per_token_is_no_rate() -> None:
    signals = CostEstimator().signals(1, [], ForwardCost(0.5, 0.0))
    assert (signals.prefill_rate_tps, signals.forward_s) == (None, 0.0)


def test_the_signals_carry_the_forward_cost_and_the_batch_shape() -> None:
    estimator = CostEstimator(chunk_size=512, max_batch_tokens=2048)
    signals = estimator.signals(0, [], ForwardCost(0.04, 0.002))
    assert signals.forward_s == 0.04
    assert signals.prefill_rate_tps == pytest.approx(500.0)
    assert (signals.chunk_size, signals.max_batch_tokens) == (512, 2048)


# ---- the forward cost and the arrival rate ----------------------------------------------


def test_the_fit_finds_a_forwards_fixed_and_per_token_cost() -> None:
    forwards = [(0.05 + 0.002 * t, t) for t in (16, 64, 512, 100, 2048)]
    cost = fit_forward_cost(forwards)
    assert cost is not None
    assert cost.forward_s == pytest.approx(0.05)
    assert cost.seconds_per_token == pytest.approx(0.002)


def test_forwards_twice_as_large_are_enough_for_the_line() -> None:
    for sizes in ((100, 200), (100, 250)):  # 2x exactly; between 2x and 3x
        cost = fit_forward_cost([(0.05 + 0.002 * t, t) for t in sizes])
        assert cost is not None
        assert cost.forward_s == pytest.approx(0.05)
        assert cost.seconds_per_token == pytest.approx(0.002)


def test_forwards_of_one_size_or_a_line_that_is_noise_give_the_plain_average() -> None:
    assert fit_forward_cost([]) is None
    same_size = [(0.1, 100), (0.3, 100), (0.2, 150)]  # spans less than 2x: no line
    bigger_is_faster = [(0.5, 10), (0.1, 100)]  # a negative slope: noise
    through_below_zero = [(0.01, 100), (0.5, 1000)]  # a negative intercept
    flat = [(0.2, 100), (0.2, 300)]  # no per-token cost at all: noise too
    for forwards in (same_size, bigger_is_faster, through_below_zero, flat):
        cost = fit_forward_cost(forwards)
        assert cost is not None and cost.forward_s == 0.0
        total_s, total_tokens = (sum(column) for column in zip(*forwards, strict=True))
        assert cost.seconds_per_token == pytest.approx(total_s / total_tokens)


def test_the_arrival_rate_is_tokens_over_the_last_window() -> None:
    rate = ArrivalRate(started_at=100.0, window_s=10.0)
    assert rate.observe(100.0, 0) == 0.0
    assert rate.observe(102.0, 400) == pytest.approx(400 / 2.0)  # younger than the window
    assert rate.observe(110.0, 1000) == pytest.approx(1000 / 10.0)
    assert rate.observe(113.0, 1000) == pytest.approx(600 / 10.0)  # the 400 at 102 left
    assert rate.observe(130.0, 1000) == 0.0  # nothing in the last 10 s
    assert rate.observe(131.0, 1300) == pytest.approx(300 / 10.0)
    assert rate.observe(141.0, 1300) == 0.0  # the 300 at 131: exactly a window ago, left


def test_a_worker_younger_than_a_second_has_a_rate() -> None:
    rate = ArrivalRate(started_at=100.0, window_s=10.0)
    assert rate.observe(100.5, 50) == pytest.approx(50 / 0.5)


def test_overheads_come_from_the_last_window_of_successes() -> None:
    estimator = CostEstimator(window=3)
    for bootstrap_s, transfer_s in ((0.5, 90.0), (3.0, 0.1), (1.0, 0.3), (2.0, 0.2)):
        estimator.on_outcome(_outcome(bootstrap_s, transfer_s))
    signals = estimator.signals(0, [], None)  # 0.5 / 90.0 left the window
    assert (signals.handshake_s, signals.transfer_s) == (1.0, 0.2)  # lowest; median


def test_the_handshake_is_the_lowest_tenth_of_the_bootstrap_waits() -> None:
    """Under load most requests also waited for the forward in flight when they arrived (the
    engine sees a want only between forwards): their median is that forward, not the decode."""
    estimator = CostEstimator()
    for bootstrap_s in range(29, 0, -1):  # 29 .. 1: the lowest tenth is index 2 (2.9 down)
        estimator.on_outcome(_outcome(float(bootstrap_s), 1.0))
    assert estimator.signals(0, [], None).handshake_s == 3.0


def test_failed_requests_do_not_count() -> None:
    estimator = CostEstimator()
    estimator.on_outcome(_outcome(1.0, 0.5))
    estimator.on_outcome(_outcome(50.0, 50.0, ok=False))
    signals = estimator.signals(0, [], None)
    assert (signals.handshake_s, signals.transfer_s) == (1.0, 0.5)


def test_requests_that_computed_nothing_do_not_count() -> None:
    """A success that computed no token (its whole prompt a prefix hit) did no work: its wait
    predicts nothing about a request that will."""
    estimator = CostEstimator()
    estimator.on_outcome(_outcome(1.5, 2.0, num_computed=0))
    signals = estimator.signals(0, [], None)
    assert (signals.handshake_s, signals.transfer_s) == (0.0, 0.0)
    estimator.on_outcome(_outcome(0.02, 0.1, num_computed=1))
    signals = estimator.signals(0, [], None)
    assert (signals.handshake_s, signals.transfer_s) == (0.02, 0.1)


def test_handshake_and_push_times_age_out() -> None:
    """A burst of late claims (bootstrap waits of 1.5 s) no longer pins the handshake once it
    is SAMPLE_MAX_AGE_S old, even with no request since (issue #40: it pinned it for ever)."""
    clock = FakeClock(0.0)
    estimator = CostEstimator(clock)
    for _ in range(12):
        estimator.on_outcome(_outcome(1.5, 0.2))
    clock.advance(10.0)
    estimator.on_outcome(_outcome(0.01, 0.1))
    assert estimator.signals(0, [], None).handshake_s == 1.5  # the lowest tenth: still late
    clock.advance(SAMPLE_MAX_AGE_S - 10.0)
    assert estimator.signals(0, [], None).handshake_s == 1.5  # the burst is exactly 60 s old
    clock.advance(0.001)
    signals = estimator.signals(0, [], None)
    assert (signals.handshake_s, signals.transfer_s) == (0.01, 0.1)  # only the newer one left
    clock.advance(10.0)
    signals = estimator.signals(0, [], None)
    assert (signals.handshake_s, signals.transfer_s) == (0.0, 0.0)  # none left


def test_an_undetermined_window_keeps_the_last_lines_rate() -> None:
    """Forwards of one size refit only the fixed part of a line determined before (issue #40:
    70 one-token forwards made a 10k tokens/s worker's rate ~400 tokens/s)."""
    line = ForwardCost(0.002, 0.0001)  # 10k tokens/s, 2 ms a forward
    one_token = [(0.0025, 1)] * 70
    cost = fit_forward_cost(one_token, line)
    assert cost is not None and cost.seconds_per_token == 0.0001
    assert cost.forward_s == pytest.approx(0.0024)
    assert fit_forward_cost([(0.0001, 1)], line) == ForwardCost(0.0, 0.0001)  # never negative
    determined = [(0.05 + 0.002 * t, t) for t in (16, 64)]
    assert fit_forward_cost(determined, line) == pytest.approx(fit_forward_cost(determined))


def test_the_engine_keeps_its_rate_through_a_run_of_one_token_forwards() -> None:
    cost = [0.0001]
    rig = _timed_rig(cost, chunk_size=64, max_batch_tokens=64)
    rig.backend.auto_want = True
    for i, n in enumerate([8, 16, 32, 64] * 4):
        rig.prefill(f"mixed{i}", n)
        rig.run_until_idle()
    assert rig.engine.load.costs.prefill_rate_tps == pytest.approx(10_000.0)
    for i in range(70):  # more than the window of one-token forwards
        rig.prefill(f"one{i}", 1)
        rig.run_until_idle()
    assert rig.engine.load.costs.prefill_rate_tps == pytest.approx(10_000.0)


# ---- the prediction ---------------------------------------------------------------------


def test_an_idle_worker_is_never_refused_by_the_slo() -> None:
    late = CostSignals(prefill_rate_tps=100.0, handshake_s=30.0, transfer_s=5.0)
    assert late.predicted_ttft_s(10) == pytest.approx(35.1)
    assert ttft_slo_refusal(late, 10, 1.0) is None  # idle: nothing to wait behind
    busy = CostSignals(queued_tokens=1, prefill_rate_tps=100.0, handshake_s=30.0)
    assert ttft_slo_refusal(busy, 10, 1.0) is not None
    assert ttft_slo_refusal(CostSignals(running_tokens=1, prefill_rate_tps=1.0), 10, 1.0)


def test_an_idle_worker_has_no_backlog_even_before_a_rate() -> None:
    assert CostSignals().backlog_s == 0.0
    assert CostSignals(prefill_rate_tps=100.0).backlog_s == 0.0


def test_work_without_a_rate_has_no_backlog_nor_prediction() -> None:
    cold = CostSignals(queued_tokens=1)
    assert cold.backlog_s is None
    assert cold.predicted_ttft_s(100) is None
    assert CostSignals().predicted_ttft_s(100) is None  # idle and cold: nothing to go on


def test_backlog_is_queued_and_running_tokens_over_the_rate() -> None:
    signals = CostSignals(queued_tokens=300, running_tokens=100, prefill_rate_tps=200.0)
    assert signals.backlog_s == pytest.approx(2.0)


_SHAPE = {"chunk_size": 512, "max_batch_tokens": 2048}


def test_an_idle_worker_waits_for_the_handshake_then_its_own_chunks_then_the_push() -> None:
    idle = CostSignals(0, 0, 1000.0, 0.5, 0.25, 0.1, arrival_tps=10**6, **_SHAPE)
    assert idle.predicted_ttft_s(1100) == pytest.approx(0.5 + 3 * 0.1 + 1.1 + 0.25)  # 3 chunks
    assert CostSignals(0, 0, 100.0).predicted_ttft_s(100) == pytest.approx(1.0)


def test_the_forward_in_flight_counts_half_then_the_one_planned_next_in_full() -> None:
    # 1000 running tokens: the forward in flight (1.1 s, half gone on average); the 500 queued
    # go in the forward planned next (0.6 s); then its own chunk's forward
    signals = CostSignals(500, 1000, 1000.0, forward_s=0.1, transfer_s=0.25, **_SHAPE)
    assert signals.predicted_ttft_s(100) == pytest.approx(1.1 / 2 + 0.6 + 0.2 + 0.25)
    slow_decode = CostSignals(500, 1000, 1000.0, 2.0, 0.25, 0.1, **_SHAPE)
    assert slow_decode.predicted_ttft_s(100) == pytest.approx(2.0 + 0.2 + 0.25)  # the longer
    # running work beyond one forward's budget is planned next, not in flight
    deep = CostSignals(0, 3000, 1000.0, forward_s=0.1, **_SHAPE)
    assert deep.predicted_ttft_s(100) == pytest.approx(2.148 / 2 + 1.052 + 0.2)
    queued = CostSignals(1000, 0, 1000.0, forward_s=0.1, **_SHAPE)  # nothing in flight
    assert queued.predicted_ttft_s(1100) == pytest.approx(1.1 + 3 * 0.1 + 1.1)


def test_the_backlog_beyond_the_next_forward_shares_the_new_requests_forwards() -> None:
    # 5000 queued: 2048 in the forward planned next; the other 2952 and its 100 tokens fill two
    # forwards (FCFS, 2048 tokens a forward), not three of the backlog and one of its own
    signals = CostSignals(5000, 0, 1000.0, forward_s=0.1, **_SHAPE)
    assert signals.backlog_s == pytest.approx(3 * 0.1 + 5.0)
    assert signals.predicted_ttft_s(100) == pytest.approx(2.148 + 2 * 0.1 + 3.052)
    # 2000 left: with its 100 tokens they overflow one forward into a second
    brim = CostSignals(4048, 0, 1000.0, forward_s=0.1, **_SHAPE)
    assert brim.predicted_ttft_s(100) == pytest.approx(2.148 + 2 * 0.1 + 2.1)
    # its own chunks set the number when there are more of them: 1100 tokens, 3 chunks
    assert CostSignals(2148, 0, 1000.0, forward_s=0.1, **_SHAPE).predicted_ttft_s(
        1100
    ) == pytest.approx(2.148 + 3 * 0.1 + 1.2)


def test_an_unknown_batch_shape_is_one_forward() -> None:
    signals = CostSignals(3000, 1000, 1000.0, forward_s=0.1)  # an older worker's pong
    assert signals.backlog_s == pytest.approx(0.1 + 4.0)
    assert signals.predicted_ttft_s(1100) == pytest.approx(1.1 / 2 + 3.1 + 0.1 + 1.1)
    flood = CostSignals(3000, 1000, 1000.0, forward_s=0.1, arrival_tps=10**6)  # no room
    assert flood.predicted_ttft_s(1100) == pytest.approx(1.1 / 2 + 3.1 + 0.1 + 1.1)
    assert CostSignals(0, 0, 1000.0, forward_s=0.1).predicted_ttft_s(0) == 0.0


def test_arrivals_during_the_forward_in_flight_join_its_forwards_up_to_their_room() -> None:
    # 1000 tokens in flight (1 s): the arrivals meanwhile are taken with it, after that forward
    quiet = CostSignals(0, 1000, 1000.0, arrival_tps=0.0, **_SHAPE)
    assert quiet.predicted_ttft_s(100) == pytest.approx(0.5 + 0.1)
    busy = CostSignals(0, 1000, 1000.0, arrival_tps=300.0, **_SHAPE)
    assert busy.predicted_ttft_s(100) == pytest.approx(0.5 + 0.1 + 300 * 1.0 / 1000)
    flood = CostSignals(0, 1000, 1000.0, arrival_tps=10**6, **_SHAPE)
    assert flood.predicted_ttft_s(100) == pytest.approx(0.5 + 2048 / 1000)  # its forward full
    room = 3 * 2048 - 1100  # its own 3 chunks are 3 forwards: room beside each
    assert flood.predicted_ttft_s(1100) == pytest.approx(0.5 + (1100 + room) / 1000)
    behind = CostSignals(2100, 1000, 1000.0, arrival_tps=10**6, **_SHAPE)
    room = 2048 - 52 - 100  # 52 queued tokens beyond the next forward share its forward
    assert behind.predicted_ttft_s(100) == pytest.approx(0.5 + 2.048 + (52 + 100 + room) / 1000)
    # nothing in flight: nobody arrives while it waits for one
    assert CostSignals(0, 0, 1000.0, arrival_tps=10**6, **_SHAPE).predicted_ttft_s(
        100
    ) == pytest.approx(0.1)
    assert CostSignals(1000, 0, 1000.0, arrival_tps=10**6, **_SHAPE).predicted_ttft_s(
        100
    ) == pytest.approx(1.0 + 0.1)


def test_the_slo_refuses_only_a_prediction_over_it() -> None:
    signals = CostSignals(100, 0, 100.0)  # 1 s of backlog
    assert ttft_slo_refusal(signals, 100, None) is None
    assert ttft_slo_refusal(signals, 100, 2.0) is None  # exactly at the SLO: admitted
    why = ttft_slo_refusal(signals, 101, 2.0)
    assert why is not None and "2.010" in why and "2.000" in why
    assert ttft_slo_refusal(CostSignals(queued_tokens=10**9), 1, 0.001) is None  # cold
    assert TTFT_SLO_REJECT == "ttft_slo"


# ---- what the engine publishes ----------------------------------------------------------


def _timed_rig(seconds_per_token: list[float], **kw: object) -> Rig:
    """Each forward advances the clock by its tokens times ``seconds_per_token[0]``."""
    rig = make_rig(auto_want=False, **kw)  # type: ignore[arg-type]
    rig.runner.on_run = lambda plan: rig.clock.advance(plan.num_tokens * seconds_per_token[0])
    return rig


def test_a_cold_idle_engine_publishes_zeros_and_no_rate() -> None:
    rig = _timed_rig([0.01])
    rig.steps(3)
    assert rig.engine.load.costs == CostSignals(chunk_size=16, max_batch_tokens=32)


def test_the_engine_publishes_its_forwards_fixed_cost_and_the_arrivals() -> None:
    rig = make_rig(auto_want=True, chunk_size=16, max_batch_tokens=32)
    started = rig.clock()  # the engine's start: the arrival window opens there
    rig.runner.on_run = lambda plan: rig.clock.advance(0.05 + 0.01 * plan.num_tokens)
    for i, num_tokens in enumerate((4, 16, 32, 8, 30)):
        rig.prefill(f"r{i}", num_tokens)
        rig.run_until_idle()
    costs = rig.engine.load.costs
    assert costs.forward_s == pytest.approx(0.05)
    assert costs.prefill_rate_tps == pytest.approx(100.0)
    assert rig.clock() - started < 10.0  # younger than the window: the rate is since start
    assert costs.arrival_tps == pytest.approx(90 / (rig.clock() - started))


def test_queued_tokens_count_whole_prompts_until_admitted() -> None:
    rig = _timed_rig([0.01])
    rig.prefill("a", 40)
    rig.prefill("b", 24)
    rig.steps()
    assert rig.engine.load.costs.queued_tokens == 64
    assert rig.engine.load.costs.backlog_s is None  # work, and no forward measured yet
    rig.sender("a").want()
    rig.steps()  # admitted, its first chunk (16) launched: not computed yet
    costs = rig.engine.load.costs
    assert (costs.queued_tokens, costs.running_tokens) == (24, 40)
    assert costs.prefill_rate_tps is None
    rig.steps()  # the first chunk computed, the second launched
    costs = rig.engine.load.costs
    assert costs.queued_tokens == 24
    assert costs.running_tokens == 40 - 16
    assert costs.prefill_rate_tps == pytest.approx(100.0)
    assert costs.backlog_s == pytest.approx((24 + 24) / 100.0)
    rig.abort("b")
    rig.steps()
    assert rig.engine.load.costs.queued_tokens == 0


def test_a_forward_in_flight_sees_the_turns_arrivals_published() -> None:
    """A pong answered while the engine waits for the forward in flight sees the requests
    that turn took and planned, not the load of the turn before."""
    rig = make_rig(auto_want=True, chunk_size=16, max_batch_tokens=32)
    seen: list[tuple[int, int, int]] = []
    rig.runner.on_run = lambda plan: seen.append(
        (plan.num_tokens, rig.engine.load.num_prefilling, rig.engine.load.costs.running_tokens)
    )
    rig.prefill("a", 32)
    rig.steps()  # a's first chunk (16) launched
    rig.prefill("b", 8)
    rig.steps()  # a's second chunk and b planned, then the first forward runs
    assert seen == [(16, 2, 32 + 8)]


def test_the_rate_follows_the_recent_forwards_not_all_time() -> None:
    cost = [0.01]
    rig = _timed_rig(cost, chunk_size=16, max_batch_tokens=16)
    rig.backend.auto_want = True
    for i in range(70):
        rig.prefill(f"fast{i}", 16)
    rig.run_until_idle()
    assert rig.engine.load.costs.prefill_rate_tps == pytest.approx(100.0)
    cost[0] = 0.04
    for i in range(70):  # more forwards than the window (64) holds
        rig.prefill(f"slow{i}", 16)
    rig.run_until_idle()
    assert rig.engine.load.costs.prefill_rate_tps == pytest.approx(25.0)


def test_handshake_and_push_times_come_from_finished_requests() -> None:
    rig = _timed_rig([0.01])
    rig.prefill("a", 8)
    rig.steps()
    rig.clock.advance(0.5)  # the decode answers the handshake half a second later
    rig.sender("a").want()
    rig.run_until_idle()
    costs = rig.engine.load.costs
    assert rig.outcome("a").status is OutcomeStatus.OK
    assert costs.handshake_s == pytest.approx(rig.outcome("a").timings.bootstrap_s)
    assert costs.handshake_s >= 0.5
    assert costs.transfer_s == pytest.approx(rig.outcome("a").timings.transfer_s)


def test_prefix_hits_are_not_running_tokens() -> None:
    rig = _timed_rig([0.01], prefix_cache=True, chunk_size=8, max_batch_tokens=8)
    rig.backend.auto_want = True
    tokens = list(range(1, 25))
    rig.prefill("first", 24, token_ids=tokens)
    rig.run_until_idle()
    rig.prefill("second", 24, token_ids=[*tokens[:16], 99, 98, 97, 96, 95, 94, 93, 92])
    rig.steps()  # admitted with a 16-token hit; its one 8-token chunk launched
    costs = rig.engine.load.costs
    assert rig.engine.load.num_prefilling == 1
    assert costs.running_tokens == 24 - 16
    assert rig.outcome("first").num_computed_tokens == 24
    assert costs.queued_tokens == 0


def test_the_default_window_is_the_last_64_requests() -> None:
    estimator = CostEstimator()
    for i, seconds in enumerate([100.0] * 33 + [1.0] * 32):
        estimator.on_outcome(_outcome(0.5 if i < 7 else 9.0, seconds))
    signals = estimator.signals(0, [], None)  # the first left: 100.0 x 32 and 1.0 x 32
    assert signals.transfer_s == pytest.approx(50.5)
    assert signals.handshake_s == 9.0  # six 0.5 left: the 7th lowest of 64 is 9.0
