"""Both forward strategies at their edges: one plan at a time, said in words; the threaded one
runs on its named thread and signals its fd exactly while a finished plan waits (found
unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import select
import threading

import pytest

from prefill_worker.batch import BatchOutput, BatchPlan
from prefill_worker.scheduler.forward import SerialForward, ThreadedForward, make_forward
from tests.polling import wait_until

PLAN = BatchPlan(3, ())


class NamingRunner:
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.release = threading.Event()

    def run(self, plan: BatchPlan) -> BatchOutput:
        self.threads.append(threading.current_thread().name)
        assert self.release.wait(10)
        return BatchOutput(plan.batch_id, ())


def is_readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.mark.parametrize("strategy", [SerialForward, ThreadedForward])
def test_one_plan_at_a_time_in_words(strategy: type) -> None:
    runner = NamingRunner()
    runner.release.set()
    forward = strategy(runner)
    try:
        with pytest.raises(AssertionError, match=r"^nothing launched$"):
            forward.collect()
        forward.launch(PLAN)
        with pytest.raises(AssertionError, match=r"^previous plan not collected$"):
            forward.launch(PLAN)
        assert forward.collect() == BatchOutput(3, ())
    finally:
        forward.close()


def test_the_serial_strategy_is_always_done_and_forgets_a_plan_on_close() -> None:
    runner = NamingRunner()
    runner.release.set()
    forward = SerialForward(runner)
    assert forward.is_done() and forward.done_fd is None
    forward.launch(PLAN)
    assert forward.is_done()
    forward.close()
    forward.launch(PLAN)  # the closed plan is gone: a new one may be launched
    assert forward.collect() == BatchOutput(3, ()) and runner.threads == ["MainThread"]


def test_the_threaded_strategy_signals_a_finished_plan_until_collected() -> None:
    runner = NamingRunner()
    forward = ThreadedForward(runner)
    try:
        assert forward.is_done() and not is_readable(forward.done_fd)
        forward.launch(PLAN)
        assert not forward.is_done() and not is_readable(forward.done_fd)
        runner.release.set()
        assert select.select([forward.done_fd], [], [], 10)[0]
        wait_until(forward.is_done, what="the future done (it settles just after the byte)")
        assert forward.collect() == BatchOutput(3, ())
        assert forward.is_done() and not is_readable(forward.done_fd)
        assert runner.threads[0].startswith("forward")
    finally:
        forward.close()


def test_overlap_picks_the_threaded_strategy() -> None:
    runner = NamingRunner()
    threaded, serial = make_forward(runner, True), make_forward(runner, False)
    assert isinstance(threaded, ThreadedForward) and isinstance(serial, SerialForward)
    threaded.close()
