"""The leader's side of the group while serving: the runner every forward goes through, the
idle heartbeat, and the group's health.

``GroupRunner`` is the scheduler's ``ModelRunner`` at TP > 1: each plan goes to every rank
as one step (``channel.py``) and the leader runs its own shard and samples inside the same
exchange. The engine does not know the group exists. ``Heartbeat`` exchanges an empty step
whenever no step went out for ``interval_s``, so a rank that stopped or died is found within
``interval_s + step_timeout_s`` even when no request comes (and followers, whose wait for the
next step is bounded by the same timeout, never time out on an idle leader).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner
from prefill_worker.tp.channel import GroupFailed, LeaderChannel
from prefill_worker.tp.followers import Followers
from prefill_worker.tp.step import StepKind

log = logging.getLogger(__name__)

RankSeconds = Callable[[tuple[float, ...]], None]  # each rank's forward seconds, rank order


class GroupRunner:
    """A ``ModelRunner`` that runs each plan on every rank of the group. ``local`` is the
    leader's own runner (its shard, its pools): what start-up reads the leader's model from
    (the hybrid state's whole slots, a DSA model's index pages), never run directly."""

    def __init__(self, runner: ModelRunner, channel: LeaderChannel, on_forward: RankSeconds):
        self.local = runner
        self._runner, self._channel, self._on_forward = runner, channel, on_forward

    def run(self, plan: BatchPlan) -> BatchOutput:
        output, replies = self._channel.exchange(
            StepKind.FORWARD, plan, lambda: self._runner.run(plan)
        )
        self._on_forward(replies.forward_s)
        assert output is not None
        return output


def local_runner(runner: ModelRunner) -> ModelRunner:
    """The leader's own runner behind a group's (``GroupRunner.local``); at TP 1 ``runner``."""
    return runner.local if isinstance(runner, GroupRunner) else runner


class Heartbeat:
    """A thread: an empty step after ``interval_s`` without one; ``on_failure`` once the
    group failed (the daemon then stops the worker)."""

    def __init__(
        self, channel: LeaderChannel, interval_s: float, on_failure: Callable[[], None]
    ) -> None:
        self._channel, self._interval_s, self._on_failure = channel, interval_s, on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tp heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s / 4):
            idle_s = self._channel.clock() - self._channel.last_exchange_at
            if idle_s < self._interval_s:
                continue
            try:
                self._channel.exchange(StepKind.HEARTBEAT)
            except GroupFailed as exc:
                if not self._stop.is_set():
                    log.error("tensor parallel: heartbeat failed: %s", exc)
                    self._on_failure()
                return


class LeaderGroup:
    """What the daemon holds of the group: its health, and its orderly end."""

    def __init__(
        self,
        channel: LeaderChannel,
        followers: Followers,
        heartbeat: Heartbeat,
        stuck_after_s: float,
    ) -> None:
        self.channel, self.followers, self._heartbeat = channel, followers, heartbeat
        self._stuck_after_s = stuck_after_s

    def start_heartbeat(self) -> None:
        self._heartbeat.start()

    def problem(self) -> str | None:
        """Why the group cannot serve any more (a follower exited, a step failed); None
        while it is whole."""
        return self.followers.first_dead() or self.channel.failure

    def is_busy(self) -> bool:
        """Never: the leader's engine holds every request of the group."""
        return False

    def stuck(self) -> str | None:
        """For ``/livez``: a failed group, a follower the kernel holds stopped, or ranks that
        have not answered a step for longer than ``stuck_after_s``."""
        problem = self.problem()
        if problem is not None:
            return f"tensor-parallel group failed: {problem}"
        stopped = self.followers.first_stopped()  # mid-forward too: no step need be waiting
        if stopped is not None:
            return f"a tensor-parallel {stopped}"
        waited_s = self.channel.waiting_for()
        if waited_s > self._stuck_after_s:
            return f"a tensor-parallel rank has not answered a step for {waited_s:.1f} s"
        return None

    def close(self, grace_s: float) -> None:
        """Stop the heartbeat, tell the followers to leave, reap them (kill after
        ``grace_s``). A failed group's followers are killed at once: they cannot leave in
        order (a stopped one never would)."""
        self._heartbeat.stop()
        self.channel.stop()
        self.followers.close(0.0 if self.problem() is not None else grace_s)
