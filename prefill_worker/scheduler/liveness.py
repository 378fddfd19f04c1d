"""Busy or stuck: the engine's progress, and the rule ``/livez`` and the watchdog judge it by.

The loop does not turn during a forward, and a forward of 8192 tokens takes a fraction of a
second on a GPU and minutes on a CPU, so a fixed staleness bound either restarts a busy worker
or keeps a hung one "healthy". ``ForwardClock`` wraps the model runner: it records the forward
in progress and measures seconds per token over recent forwards. ``LivenessRule`` says::

    live    the loop turned within loop_stale_s
            or a forward is running and younger than its bound
    stuck   a forward older than its bound (whatever the loop did)
            or no turn for loop_stale_s and no forward running

    bound = max(floor_s, margin × num_tokens × seconds_per_token)

``seconds_per_token`` is total time over total tokens of the last ``window`` forwards (the
bound errs long, never short); before the first forward finishes the bound is the floor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner
from prefill_worker.scheduler.costs import ForwardCost, fit_forward_cost, is_determined


@dataclass(frozen=True, slots=True)
class ForwardInProgress:
    started_at: float  # the engine clock when the runner began
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Progress:
    """The engine's progress as another thread sees it (one snapshot, built whole).

    ``last_sign_at`` is the later of the loop's last turn and the last forward's end, so a
    forward that just ended never reads as a silent loop."""

    last_sign_at: float
    forward: ForwardInProgress | None = None
    seconds_per_token: float | None = None


class ForwardClock:
    """A ``ModelRunner`` that times the runner it wraps. ``run`` belongs to whichever thread
    runs forwards; ``progress`` may be called from any thread (the state is one attribute,
    replaced whole)."""

    def __init__(
        self, runner: ModelRunner, clock: Callable[[], float] = time.monotonic, window: int = 64
    ) -> None:
        self._runner, self._clock = runner, clock
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)
        self._state = Progress(last_sign_at=clock())
        self._cost: ForwardCost | None = None
        self._line: ForwardCost | None = None  # the last fit of a window that determined one
        # When the last forward that returned started and ended (read once it is collected).
        self.last_forward = (0.0, 0.0)

    @property
    def seconds_per_token(self) -> float | None:
        """The recent forwards' compute time per token; None before the first forward."""
        return self._state.seconds_per_token

    @property
    def cost(self) -> ForwardCost | None:
        """The recent forwards' fixed and per-token cost (``costs.fit_forward_cost``)."""
        return self._cost

    def progress(self, last_turn_at: float) -> Progress:
        """The forward's state, with ``last_turn_at`` (read before this call) folded in."""
        state = self._state
        if last_turn_at <= state.last_sign_at:
            return state
        return Progress(last_turn_at, state.forward, state.seconds_per_token)

    def run(self, plan: BatchPlan) -> BatchOutput:
        started, before = self._clock(), self._state
        forward = ForwardInProgress(started, plan.num_tokens)
        self._state = Progress(before.last_sign_at, forward, before.seconds_per_token)
        seconds_per_token = before.seconds_per_token
        try:
            output = self._runner.run(plan)
            ended = self._clock()
            self.last_forward = (started, ended)
            seconds_per_token = self._measure(ended - started, plan.num_tokens)
            return output
        finally:
            self._state = Progress(self._clock(), None, seconds_per_token)

    def _measure(self, seconds: float, num_tokens: int) -> float:
        self._recent.append((seconds, max(num_tokens, 1)))
        self._cost = fit_forward_cost(self._recent, self._line)
        if is_determined([n for _, n in self._recent]):
            self._line = self._cost  # the rate an undetermined window keeps
        total_s = sum(s for s, _ in self._recent)
        return total_s / sum(n for _, n in self._recent)


@dataclass(frozen=True, slots=True)
class Verdict:
    is_live: bool
    reason: str  # one line for the probe's body and the log


@dataclass(frozen=True, slots=True)
class LivenessRule:
    loop_stale_s: float
    forward_floor_s: float
    forward_margin: float

    def bound_s(self, num_tokens: int, seconds_per_token: float | None) -> float:
        """How long a forward of ``num_tokens`` may run before it counts as stuck."""
        if seconds_per_token is None:
            return self.forward_floor_s
        return max(self.forward_floor_s, self.forward_margin * num_tokens * seconds_per_token)

    def judge(self, progress: Progress, now: float) -> Verdict:
        forward = progress.forward
        if forward is not None:
            running_s = now - forward.started_at
            bound_s = self.bound_s(forward.num_tokens, progress.seconds_per_token)
            what = f"a forward of {forward.num_tokens} tokens has run {running_s:.1f} s"
            if running_s > bound_s:
                return Verdict(False, f"stuck: {what}, past its bound of {bound_s:.1f} s")
            return Verdict(True, f"busy: {what} (bound {bound_s:.1f} s)")
        silent_s = now - progress.last_sign_at
        if silent_s > self.loop_stale_s:
            return Verdict(False, f"stuck: the engine loop has not turned for {silent_s:.1f} s")
        return Verdict(True, "live")
