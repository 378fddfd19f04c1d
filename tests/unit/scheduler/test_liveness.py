"""Liveness tells busy from stuck: a forward within its bound (tokens × measured seconds per
token × margin, at least the floor) is live however long the loop has been silent; a forward
past it is stuck, and so is a loop that stopped turning with no forward running. Through the
engine's public seams: a runner that advances the fake clock by its tokens, and one held on
an event."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from prefill_worker.batch import BatchOutput, BatchPlan
from prefill_worker.scheduler.liveness import (
    ForwardClock,
    ForwardInProgress,
    LivenessRule,
    Progress,
)
from tests.clocks import FakeClock
from tests.unit.scheduler.fakes import Rig, make_rig

SECONDS_PER_TOKEN = 0.1
RULE = LivenessRule(loop_stale_s=5.0, forward_floor_s=1.0, forward_margin=4.0)


def test_the_bound_is_the_floor_until_a_forward_was_timed_then_scales_with_tokens() -> None:
    assert RULE.bound_s(8192, None) == 1.0
    assert RULE.bound_s(1, 0.1) == 1.0  # 0.4 s: the floor wins
    assert RULE.bound_s(32, 0.1) == pytest.approx(12.8)


@pytest.mark.parametrize(
    ("progress", "now", "is_live", "reason"),
    [
        (Progress(100.0), 104.0, True, "live"),
        (Progress(100.0), 106.0, False, "stuck: the engine loop has not turned for 6.0 s"),
        (Progress(100.0, ForwardInProgress(100.0, 32), 0.1), 110.0, True, "busy: "),
        (Progress(100.0, ForwardInProgress(100.0, 32), 0.1), 113.0, False, "stuck: a forward"),
        (Progress(100.0, ForwardInProgress(100.0, 32), None), 101.5, False, "past its bound"),
    ],
)
def test_judge(progress: Progress, now: float, is_live: bool, reason: str) -> None:
    verdict = RULE.judge(progress, now)
    assert verdict.is_live is is_live and reason in verdict.reason


def warm_up(rig: Rig) -> None:
    """One 32-token forward that takes 0.1 s per token on the fake clock."""
    rig.runner.on_run = lambda plan: rig.clock.advance(SECONDS_PER_TOKEN * plan.num_tokens)
    rig.prefill("warm", 32)
    rig.run_until_idle()
    rig.runner.on_run = None
    assert rig.engine.progress().seconds_per_token == pytest.approx(SECONDS_PER_TOKEN)


def hold_a_forward(rig: Rig, overlap: bool) -> Callable[[], None]:
    """Start a 32-token forward that blocks until the returned function releases it (and the
    engine finishes the request). The engine is then not turning: in serial mode its thread is
    inside the forward (a turn plans it, the next runs it); in overlap mode this thread
    launched it and steps no further until the release."""
    rig.runner.gate = threading.Event()
    rig.runner.started.clear()
    rig.prefill("slow", 32)
    thread = None
    if overlap:
        rig.engine.step()
    else:
        thread = threading.Thread(target=rig.run_until_idle)
        thread.start()
    assert rig.runner.started.wait(10), "the forward never started"

    def release() -> None:
        assert rig.runner.gate is not None
        rig.runner.gate.set()
        if thread is not None:
            thread.join(10)
        rig.run_until_idle()

    return release


@pytest.mark.parametrize("overlap", [False, True])
def test_a_slow_forward_is_busy_until_its_bound_then_stuck(overlap: bool) -> None:
    rig = make_rig(overlap=overlap, chunk_size=32, max_batch_tokens=32, num_pages=32)
    warm_up(rig)
    release = hold_a_forward(rig, overlap)
    forward_at = rig.clock()
    rig.clock.advance(8.0)  # the loop is silent past loop_stale_s; the forward is in its bound
    progress = rig.engine.progress()
    assert progress.forward == ForwardInProgress(forward_at, 32)
    assert rig.clock() - progress.last_sign_at > RULE.loop_stale_s
    verdict = RULE.judge(progress, rig.clock())
    assert verdict.is_live and verdict.reason.startswith("busy"), verdict
    rig.clock.advance(5.0)  # 13 s > 4 × 32 × 0.1 s = 12.8 s
    verdict = RULE.judge(rig.engine.progress(), rig.clock())
    assert not verdict.is_live and "bound of 12.8 s" in verdict.reason, verdict
    release()
    assert RULE.judge(rig.engine.progress(), rig.clock()).is_live  # it ended: live again
    rig.check_whole()
    rig.engine.shutdown()


def test_a_loop_that_stopped_turning_without_a_forward_is_stuck() -> None:
    rig = make_rig()
    rig.engine.step()
    assert RULE.judge(rig.engine.progress(), rig.clock()).is_live
    rig.clock.advance(5.5)
    verdict = RULE.judge(rig.engine.progress(), rig.clock())
    assert not verdict.is_live and "not turned for 5.5 s" in verdict.reason
    rig.engine.step()
    assert RULE.judge(rig.engine.progress(), rig.clock()).is_live


class Raising:
    def run(self, plan: BatchPlan) -> BatchOutput:
        raise RuntimeError("boom")


def test_a_forward_that_raises_is_no_longer_in_progress_and_is_not_timed() -> None:
    clock = FakeClock()
    timed = ForwardClock(Raising(), clock)
    with pytest.raises(RuntimeError):
        timed.run(BatchPlan(1, ()))
    progress = timed.progress(last_turn_at=0.0)
    assert progress.forward is None and progress.seconds_per_token is None
    assert progress.last_sign_at == clock()
