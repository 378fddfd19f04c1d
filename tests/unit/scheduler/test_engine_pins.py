"""The engine loop's own policies, each pinned through ``Engine``'s public calls (issue #31: its
surviving mutants): how much one turn takes in, what ``step`` answers, how long an idle loop
waits and on what, what turns while a forward runs (and what does not while shutting down),
and what an operator reads in the log when something fails."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from prefill_worker.request import AbortRequest, FinishReason, Outcome
from prefill_worker.scheduler import Inbox, NullObserver
from prefill_worker.transfer.base import KVPoll
from tests.unit.scheduler.fakes import RecordingEvents, Rig, make_rig

_TURN_POLLS = 32  # bootstrapping/waiting senders polled per turn, round-robin
_TURN_MESSAGES = 256  # inbox messages taken per turn
_MAX_WAIT_S = 0.05  # an idle loop's longest wait


class StopWhen(threading.Event):
    """A stop flag that turns on by itself once ``condition()`` holds."""

    def __init__(self, condition: Callable[[], bool]) -> None:
        super().__init__()
        self.condition = condition

    def is_set(self) -> bool:
        return self.condition()


class ShortGate(threading.Event):
    """``FakeRunner.gate`` for a forward that computes until set, or for ``bound_s``."""

    def __init__(self, bound_s: float) -> None:
        super().__init__()
        self.bound_s = bound_s

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(self.bound_s)


class Steps(NullObserver):
    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self.on_outcome_hook: Callable[[Outcome], None] | None = None

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        self.steps.append((duration_s, num_batch_tokens))

    def on_outcome(self, outcome: Outcome) -> None:
        if self.on_outcome_hook is not None:
            self.on_outcome_hook(outcome)


def _record_waits(rig: Rig) -> list[tuple[float, int | None]]:
    """Every ``wait`` the engine asks of its transfer backend: (timeout, wake fd)."""
    waits: list[tuple[float, int | None]] = []
    wait = rig.backend.wait

    def recording(timeout_s: float, wake_fd: int | None = None) -> None:
        waits.append((timeout_s, wake_fd))
        wait(timeout_s, wake_fd)

    rig.backend.wait = recording  # type: ignore[method-assign]
    return waits


# ---- what one turn takes in -------------------------------------------------------------


def test_a_turn_polls_32_bootstrapping_senders_round_robin() -> None:
    # Forty senders turn ready without a claim their backend reports: one turn looks at 32
    # of them, the next turn at the rest (a flood of rooms cannot make one turn poll them all).
    rig = make_rig(max_running_requests=1, bootstrap_timeout_s=60.0, auto_want=False)
    for i in range(40):
        rig.prefill(f"r{i}", 4)
    for i in range(40):
        rig.sender(f"r{i}").state = KVPoll.READY  # not reported: only the round robin sees it
    rig.steps(1)
    assert rig.engine.load.num_bootstrapping == 40 - _TURN_POLLS
    assert rig.engine.load.num_waiting + rig.engine.load.num_prefilling == _TURN_POLLS
    rig.steps(1)
    assert rig.engine.load.num_bootstrapping == 0
    rig.run_until_idle()
    assert {o.reason for o in rig.outcomes} == {FinishReason.OK}
    rig.check_whole()


def test_a_claim_is_seen_the_next_turn_however_many_wait_unclaimed() -> None:
    # A thousand requests whose decode never comes: a claim the backend reports is polled
    # the next turn, not when the round robin (32 a turn) reaches it (#40 finding 4).
    rig = make_rig(bootstrap_timeout_s=600.0, auto_want=False)
    for i in range(1000):
        rig.prefill(f"idle{i}", 4)
    rig.prefill("legit", 4)
    rig.steps(3)
    rig.sender("legit").want()
    rig.steps(1)
    assert rig.engine.load.num_bootstrapping == 1000
    assert rig.engine.load.num_waiting + rig.engine.load.num_prefilling == 1
    rig.steps(20)
    assert [o.request_id for o in rig.outcomes] == ["legit"]


def test_a_claim_that_came_first_is_seen_as_the_request_arrives() -> None:
    rig = make_rig(bootstrap_timeout_s=600.0, auto_want=False)
    for i in range(100):
        rig.prefill(f"idle{i}", 4)
    rig.steps(1)
    rig.backend.auto_want = True  # the next sender is created bound (its want came first)
    rig.prefill("legit", 4)
    rig.steps(1)  # the round robin looks at idle0..31 (the ring's head) this turn
    assert rig.engine.load.num_bootstrapping == 100
    assert rig.engine.load.num_waiting + rig.engine.load.num_prefilling == 1


def test_a_turn_takes_at_most_256_inbox_messages() -> None:
    rig = make_rig()
    inbox = Inbox()
    for i in range(300):
        inbox.put(AbortRequest(f"unknown-{i}"))  # unknown ids: taken and ignored
    rig.engine.run(StopWhen(lambda: rig.backend.num_polls >= 1), inbox)  # one turn
    assert inbox.qsize() == 300 - _TURN_MESSAGES
    rig.engine.run(StopWhen(lambda: rig.backend.num_polls >= 2), inbox)
    assert inbox.empty()
    inbox.close()


# ---- what step answers, and what the observer hears ------------------------------------


def test_step_is_true_only_for_a_turn_that_launched_or_collected_a_forward() -> None:
    steps = Steps()
    rig = make_rig(chunk_size=4, max_batch_tokens=4, observer=steps)
    rig.prefill("a", 8)  # two chunks: launched, launched and collected, collected
    assert [rig.engine.step() for _ in range(4)] == [True, True, True, False]
    assert [tokens for _, tokens in steps.steps] == [4, 4, 0]  # an idle turn is no step
    assert rig.outcome("a").reason is FinishReason.OK
    rig.check_whole()


def test_the_step_time_the_observer_hears_is_within_the_turn() -> None:
    steps = Steps()
    rig = make_rig(observer=steps)
    rig.prefill("a", 8)
    started = time.perf_counter()
    assert rig.engine.step()
    elapsed = time.perf_counter() - started
    [(duration_s, num_tokens)] = steps.steps
    assert 0 <= duration_s <= elapsed
    assert num_tokens == 8
    rig.run_until_idle()
    rig.check_whole()


def test_the_engine_says_its_limits() -> None:
    assert make_rig(page_size=8, chunk_size=16).engine.limits.page_size == 8


# ---- how the idle loop waits -------------------------------------------------------------


def test_an_idle_loop_waits_on_the_inbox_for_at_most_50_ms() -> None:
    rig = make_rig()
    waits = _record_waits(rig)
    inbox = Inbox()
    rig.engine.run(StopWhen(lambda: bool(waits)), inbox)
    assert waits == [(_MAX_WAIT_S, inbox.fileno())]
    inbox.close()


def test_the_idle_loop_wakes_for_the_next_deadline() -> None:
    # A room nobody asks for: its bootstrap deadline is 20 ms away, so the loop waits 20 ms,
    # not 50, and the deadline fails it on time.
    rig = make_rig(auto_want=False, bootstrap_timeout_s=0.02)
    waits = _record_waits(rig)
    rig.prefill("a", 8)
    inbox = Inbox()
    rig.engine.run(StopWhen(lambda: bool(waits)), inbox)
    [(timeout_s, wake_fd)] = waits
    assert timeout_s == pytest.approx(0.02)
    assert wake_fd == inbox.fileno()
    rig.clock.advance(0.02)
    rig.steps(1)
    assert rig.outcome("a").reason is FinishReason.BOOTSTRAP_TIMEOUT
    rig.check_whole()
    inbox.close()


# ---- while a forward runs, and while shutting down -------------------------------------


def test_a_push_that_ends_during_a_forward_is_answered_before_the_forward_returns() -> None:
    # "a" is pushing its KV while "b"'s forward computes: the backend keeps turning (waiting
    # on the forward's done fd), and "a"'s outcome goes out while "b" is still computing.
    steps = Steps()
    rig = make_rig(overlap=True, polls_to_success=1, observer=steps)
    gate = ShortGate(bound_s=5.0)
    forwards_done_at_a: list[int] = []

    def on_outcome(outcome: Outcome) -> None:
        if outcome.request_id == "a":
            forwards_done_at_a.append(len(rig.runner.plans))
            gate.set()

    steps.on_outcome_hook = on_outcome
    rig.prefill("a", 4)
    rig.steps(1)  # a's forward launched
    rig.prefill("b", 4)
    rig.runner.on_run = lambda plan: setattr(rig.runner, "gate", gate)  # b computes on
    rig.steps(1)  # a collected (now pushing); b launched
    waits = _record_waits(rig)
    rig.steps(1)  # a's status is polled once here, then again while b computes
    assert forwards_done_at_a == [1], "a was answered only after b's forward returned"
    assert waits and all(wake_fd is not None for _, wake_fd in waits), waits
    rig.run_until_idle()
    assert {o.request_id: o.reason for o in rig.outcomes} == {
        "a": FinishReason.OK,
        "b": FinishReason.OK,
    }
    rig.engine.shutdown()
    rig.check_whole()


def test_shutdown_waits_for_the_running_forward_without_turning_the_backend() -> None:
    rig = make_rig(overlap=True)
    rig.prefill("a", 4)
    rig.runner.gate = ShortGate(bound_s=0.3)  # a's forward computes for 0.3 s
    rig.steps(1)
    assert rig.runner.started.wait(5)
    polls, waits = rig.backend.num_polls, rig.backend.num_waits
    rig.engine.shutdown()
    assert (rig.backend.num_polls, rig.backend.num_waits) == (polls, waits)
    assert rig.outcome("a").reason is FinishReason.DRAINING
    assert rig.outcome("a").error == f"the worker shut down ({FinishReason.DRAINING.value})"
    rig.check_whole()


def test_a_second_shutdown_does_nothing() -> None:
    rig = make_rig(overlap=True)
    rig.prefill("a", 4)
    rig.steps(1)
    rig.engine.shutdown(FinishReason.ENGINE_ERROR)
    rig.engine.shutdown()  # the executor and its pipe are closed once
    assert [o.reason for o in rig.outcomes] == [FinishReason.ENGINE_ERROR]
    rig.check_whole()


# ---- what the log says ------------------------------------------------------------------


def _errors(caplog: pytest.LogCaptureFixture) -> list[tuple[str, bool]]:
    return [(r.getMessage(), r.exc_info is not None) for r in caplog.records if r.levelno >= 40]


def test_a_loop_failure_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig()
    rig.prefill("a", 4)
    rig.runner.fail_with = RuntimeError("device lost")
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        rig.engine.run(threading.Event(), Inbox())
    assert _errors(caplog) == [("engine loop failed", True)]
    rig.engine.shutdown()
    rig.check_whole()


def test_a_forward_that_fails_during_shutdown_is_logged_and_shutdown_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(overlap=True)
    rig.prefill("a", 4)
    rig.runner.fail_with = RuntimeError("device lost")
    rig.steps(1)
    with caplog.at_level(logging.ERROR):
        rig.engine.shutdown()
    assert _errors(caplog) == [("forward failed during shutdown", True)]
    assert rig.outcome("a").reason is FinishReason.DRAINING
    rig.check_whole()


class _BrokenEvents(RecordingEvents):
    def all_cleared(self) -> None:
        raise RuntimeError("event sink gone")


def test_a_prefix_cache_that_fails_to_reset_at_shutdown_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(prefix_cache=True, cache_events=_BrokenEvents())
    rig.prefill("a", 16)
    rig.run_until_idle()
    assert rig.engine.load.num_cached_pages > 0
    with caplog.at_level(logging.ERROR):
        rig.engine.shutdown()  # does not raise
    assert _errors(caplog) == [("prefix cache reset failed during shutdown", True)]
    assert rig.outcome("a").reason is FinishReason.OK


def test_a_claim_finds_the_live_request_of_a_room_another_one_used() -> None:
    # two live requests with one room (a backend that does not refuse the duplicate): the
    # first ends; the second's claim is still found by its room
    rig = make_rig(bootstrap_timeout_s=600.0, auto_want=False)
    for i in range(100):
        rig.prefill(f"idle{i}", 4)
    rig.prefill("first", 4, bootstrap_room=7777)
    rig.prefill("second", 4, bootstrap_room=7777)
    rig.abort("first")
    rig.steps(3)
    rig.sender("second").want()
    rig.steps(1)
    assert rig.engine.load.num_bootstrapping == 100
    rig.engine.check_integrity()
