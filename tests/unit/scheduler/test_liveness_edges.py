"""The forward clock and the liveness rule at their edges: a bound reached exactly is still
live, the rate is per token over the last 64 forwards, and a failed forward keeps the rate
(found unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import pytest

from prefill_worker.batch import BatchOutput, BatchPlan, ChunkPlan
from prefill_worker.scheduler.liveness import (
    ForwardClock,
    ForwardInProgress,
    LivenessRule,
    Progress,
    Verdict,
)


class TimedRunner:
    """Each forward takes ``seconds`` on the shared fake clock; ``fail`` raises instead."""

    def __init__(self) -> None:
        self.now, self.seconds, self.fail = 0.0, 1.0, False

    def clock(self) -> float:
        return self.now

    def run(self, plan: BatchPlan) -> BatchOutput:
        self.now += self.seconds
        if self.fail:
            raise RuntimeError("CUDA error")
        return BatchOutput(plan.batch_id, ())


def plan(num_tokens: int) -> BatchPlan:
    return BatchPlan(0, (ChunkPlan("r", [1] * num_tokens, 0, num_tokens, (0,), None),))


def test_the_rate_is_seconds_per_token_over_the_last_64_forwards() -> None:
    runner = TimedRunner()
    clock = ForwardClock(runner, runner.clock)
    runner.seconds = 100.0
    clock.run(plan(1))
    assert clock.progress(0.0).seconds_per_token == 100.0  # one token: not halved
    runner.seconds = 1.0
    for _ in range(64):
        clock.run(plan(1))
    assert clock.progress(0.0).seconds_per_token == 1.0  # the slow one left the window


def test_a_failed_forward_keeps_the_rate_and_a_later_turn_keeps_the_forward() -> None:
    runner = TimedRunner()
    clock = ForwardClock(runner, runner.clock)
    clock.run(plan(4))
    runner.fail = True
    with pytest.raises(RuntimeError):
        clock.run(plan(4))
    assert clock.progress(0.0) == Progress(2.0, None, 0.25)
    assert clock.progress(5.0) == Progress(5.0, None, 0.25)


def test_a_bound_reached_exactly_is_still_live() -> None:
    rule = LivenessRule(loop_stale_s=5.0, forward_floor_s=10.0, forward_margin=2.0)
    assert rule.judge(Progress(1.0), now=6.0) == Verdict(True, "live")
    assert not rule.judge(Progress(1.0), now=6.5).is_live
    busy = Progress(0.0, ForwardInProgress(2.0, 8), None)
    assert rule.judge(busy, now=12.0).is_live
    assert not rule.judge(busy, now=12.5).is_live
    during = Progress(0.0, ForwardInProgress(2.0, 8), 0.5)
    assert ForwardClock(TimedRunner()).progress(0.0).forward is None
    assert rule.judge(during, now=12.0).is_live  # bound: max(10, 2 * 8 * 0.5) = 10


def test_a_turn_during_a_forward_keeps_the_forward_in_view() -> None:
    seen: list[Progress] = []
    runner = TimedRunner()
    clock = ForwardClock(runner, runner.clock)
    clock.run(plan(4))  # a rate: 0.25 s per token

    def watch(plan: BatchPlan) -> BatchOutput:
        seen.append(clock.progress(50.0))
        return BatchOutput(plan.batch_id, ())

    runner.run = watch  # type: ignore[method-assign]
    clock.run(plan(2))
    assert seen == [Progress(50.0, ForwardInProgress(1.0, 2), 0.25)]
