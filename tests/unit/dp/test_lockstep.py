"""The lockstep's own rules, one rank alone (the vote's all-reduce stubbed: one rank's sum is
its own vote): plans run on the step thread, a plan with no chunks needs no step, the stop
ends the thread and refuses later plans, and a forward or a vote that raises fails the
lockstep (the waiting plan, every later one, and ``on_failure``). The ranks' agreement itself
is proven by real processes (tests/integration/model/test_dp_expert_parallel.py)."""

from __future__ import annotations

import select
import threading
from pathlib import Path

import pytest

from prefill_worker.batch import BatchOutput, BatchPlan, ChunkPlan
from prefill_worker.dp import lockstep as module
from prefill_worker.dp.lockstep import Bell, Lockstep, LockstepFailed, bell_path

PLAN = BatchPlan(7, (ChunkPlan("r", [1, 2], 0, 2, [0], None),))


class Runner:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.plans, self.idle = error, [], 0

    def run(self, plan: BatchPlan) -> BatchOutput:
        if self.error is not None and plan.chunks:
            raise self.error
        self.plans.append(plan.batch_id)
        return BatchOutput(plan.batch_id, ())

    def run_idle(self) -> int:
        self.idle += 1
        return 0


@pytest.fixture
def votes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    seen: list[list[int]] = []
    monkeypatch.setattr(module.dist, "all_reduce", lambda t, group: seen.append(t.tolist()))
    return seen


def start(tmp_path: Path, runner: Runner, on_failure=None) -> Lockstep:  # type: ignore[no-untyped-def]
    bell = Bell(bell_path(str(tmp_path)), listen=True)
    lockstep = Lockstep(runner, 0, None, bell, interval_s=0.05, on_failure=on_failure)
    lockstep.start()
    return lockstep


def test_plans_run_in_steps_and_the_stop_ends_them(tmp_path: Path, votes) -> None:
    runner = Runner()
    lockstep = start(tmp_path, runner)
    assert lockstep.run(PLAN).batch_id == 7
    assert lockstep.run(BatchPlan(8, ())).batch_id == 8  # no chunks: no step
    assert runner.plans == [7, 8] and [0, 1] in votes and [1] in votes  # wanted; had a plan
    lockstep.stop(5.0)
    assert votes[-1] == [1, 0] and lockstep.counts.busy == 1 and lockstep.failure is None
    assert not lockstep._thread.is_alive()
    with pytest.raises(LockstepFailed, match="stopped"):
        lockstep.run(PLAN)


def test_a_forward_that_raises_fails_the_lockstep(tmp_path: Path, votes) -> None:
    failed = threading.Event()
    lockstep = start(tmp_path, Runner(ValueError("bad plan")), failed.set)
    with pytest.raises(ValueError, match="bad plan"):
        lockstep.run(PLAN)
    assert failed.wait(5.0)
    assert lockstep.failure is not None and "bad plan" in lockstep.failure
    with pytest.raises(LockstepFailed, match="lockstep failed on rank 0"):
        lockstep.run(PLAN)
    lockstep.stop(1.0)


def test_a_vote_that_raises_fails_the_waiting_plan(tmp_path: Path, monkeypatch) -> None:
    def gone(tensor, group):  # type: ignore[no-untyped-def]
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(module.dist, "all_reduce", gone)
    failed = threading.Event()
    lockstep = start(tmp_path, Runner(), failed.set)
    with pytest.raises(LockstepFailed, match="Connection closed by peer"):
        lockstep.run(PLAN)
    assert failed.is_set()
    lockstep.stop(1.0)


def test_a_bell_rung_before_it_is_read_wakes_once(tmp_path: Path) -> None:
    bell = Bell(bell_path(str(tmp_path)), listen=True)
    ringer = Bell(bell_path(str(tmp_path)), listen=False)
    ringer.ring()
    ringer.ring()
    assert select.select([bell], [], [], 5.0)[0]
    bell.drain()
    assert not select.select([bell], [], [], 0)[0]
    Bell(str(tmp_path / "nobody"), listen=False).ring()  # rank 0 gone: no error
    for b in (bell, ringer):
        b.close()
