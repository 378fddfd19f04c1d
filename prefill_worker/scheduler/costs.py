"""The cost signals the engine publishes (``load.CostSignals``): what its queued and running
work costs in tokens, how fast it computes them, and how long the parts of a request's life
that are not compute take.

    queued_tokens    prompt tokens of BOOTSTRAPPING and WAITING requests, kept by the queues
                     as requests come and go. Whole prompts: a request's prefix hit is known
                     only when admission looks it up (looking every queued prompt up each turn
                     would cost O(queued prompt tokens) a turn), so this over-counts what a
                     warm prefix cache will serve.
    running_tokens   tokens PREFILLING requests have yet to compute: their hits are known and
                     excluded.
    forward cost     a least-squares line through the last ``ForwardClock`` window of forwards
                     (64; seconds against tokens, timed around the runner):
                     ``seconds = forward_s + tokens / prefill_rate``. A forward has a fixed
                     part (launches, the sampler, the LM head's last rows) that a short prompt
                     or a small batch pays in full; a plain tokens/s average charges it by the
                     token and misjudges both. While the window's forwards are all about the
                     same size the line is not determined: then the last determined line's
                     rate is kept and only ``forward_s`` is refitted (a run of one-token
                     forwards would otherwise turn their fixed part into a rate of a few
                     hundred tokens/s); before any line was determined, ``forward_s`` is 0
                     and the rate is tokens over seconds. A recent window follows the load.
                     None until the first forward.
    arrival_tps      prompt tokens submitted per second over the last ``ARRIVAL_WINDOW_S``
                     (since start while younger): those that arrive during the forward in
                     flight are taken with a new request and join its forwards.
    handshake_s      the lowest tenth of the bootstrap waits (arrival to the decode's want as
                     the engine saw it) of the last ``window`` requests that succeeded,
                     having computed at least one token (unclaimed, failed or zero-compute
                     requests add nothing), within
                     ``SAMPLE_MAX_AGE_S`` (older ones age out, so a burst of late claims
                     cannot pin it once it is over; none left: 0): the
                     decode's handshake. The engine sees a want only between forwards, so a
                     request that arrived while one ran waited for it as well; under load that
                     is most of them, and their median is the forward in flight, which the
                     backlog already charges. Those that found the engine idle, or arrived as
                     a forward ended, are the lowest: their wait is the handshake's own.
    transfer_s       median time from their last chunk computed to their answer (the push),
                     aged out like ``handshake_s``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prefill_worker.load import CostSignals
from prefill_worker.request import Outcome, OutcomeStatus
from prefill_worker.scheduler.tracked import Request

ARRIVAL_WINDOW_S = 10.0
SAMPLE_MAX_AGE_S = 60.0  # a request's handshake and push times count this long after it ended
HANDSHAKE_QUANTILE = 0.1  # the bootstrap waits' quantile taken as the decode's handshake


@dataclass(frozen=True, slots=True)
class ForwardCost:
    """``seconds = forward_s + tokens * seconds_per_token`` for one forward."""

    forward_s: float
    seconds_per_token: float


def fit_forward_cost(
    forwards: Iterable[tuple[float, int]], known: ForwardCost | None = None
) -> ForwardCost | None:
    """The least-squares line through ``(seconds, tokens)`` forwards. When the tokens span
    less than 2x the line is not determined: ``known`` (the last determined line) keeps its
    rate and the fixed part is refitted; without one, tokens over seconds (no fixed part).
    Tokens over seconds too when the line is not physical (a negative slope or intercept:
    noise). None without a forward."""
    samples = list(forwards)
    if not samples:
        return None
    total_s, total_tokens = sum(s for s, _ in samples), sum(t for _, t in samples)
    average = ForwardCost(0.0, total_s / total_tokens)
    tokens = [t for _, t in samples]
    mean_s, mean_t = total_s / len(samples), total_tokens / len(samples)
    if not is_determined(tokens):
        if known is None:
            return average
        slope = known.seconds_per_token
        return ForwardCost(max(0.0, mean_s - slope * mean_t), slope)
    spread = sum((t - mean_t) ** 2 for t in tokens)
    slope = sum((t - mean_t) * (s - mean_s) for s, t in samples) / spread
    intercept = mean_s - slope * mean_t
    if slope <= 0 or intercept < 0:
        return average
    return ForwardCost(intercept, slope)


def is_determined(tokens: Sequence[int]) -> bool:
    """Whether forwards of these sizes determine a line: they span at least 2x."""
    return max(tokens) >= 2 * min(tokens)


def _lowest(samples: Iterable[float], quantile: float) -> float:
    """The sample ``quantile`` of the way up the sorted ``samples`` (rounded down)."""
    ordered = sorted(samples)
    return ordered[int(quantile * len(ordered))]


class ArrivalRate:
    """Prompt tokens submitted per second over the last ``window_s``, from a running total
    sampled each turn (one sample per change)."""

    def __init__(self, started_at: float, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self._started_at, self._window_s = started_at, window_s
        self._samples: deque[tuple[float, int]] = deque([(started_at, 0)])

    def observe(self, now: float, num_arrived_tokens: int) -> float:
        """The rate as of ``now``, ``num_arrived_tokens`` the total submitted so far."""
        samples = self._samples
        if num_arrived_tokens != samples[-1][1]:
            samples.append((now, num_arrived_tokens))
        # samples[0] is the last total at or before the window's start
        while len(samples) > 1 and samples[1][0] <= now - self._window_s:
            samples.popleft()
        span_s = min(self._window_s, now - self._started_at)
        if span_s <= 0:
            return 0.0
        return (num_arrived_tokens - samples[0][1]) / span_s


class CostEstimator:
    """Keeps the recent requests' non-compute times and arrivals; turns the queues into
    ``CostSignals``. Engine thread only."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        chunk_size: int = 0,
        max_batch_tokens: int = 0,
        window: int = 64,
    ) -> None:
        self._clock = clock
        self._shape = (chunk_size, max_batch_tokens)
        self._arrivals = ArrivalRate(clock())
        # (ended at, bootstrap wait, push time) of the last ``window`` requests that succeeded
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._handshake_s = 0.0
        self._transfer_s = 0.0

    def on_outcome(self, outcome: Outcome) -> None:
        """A request ended; one that succeeded and computed something adds its handshake and
        push times (one that did no work predicts nothing about work)."""
        if outcome.status is not OutcomeStatus.OK or outcome.num_computed_tokens == 0:
            return
        timings = outcome.timings
        self._recent.append((self._clock(), timings.bootstrap_s, timings.transfer_s))
        self._summarize()

    def _age_out(self, now: float) -> None:
        """Drop the samples older than ``SAMPLE_MAX_AGE_S`` (and summarize what is left)."""
        num_before = len(self._recent)
        while self._recent and self._recent[0][0] < now - SAMPLE_MAX_AGE_S:
            self._recent.popleft()
        if len(self._recent) != num_before:
            self._summarize()

    def _summarize(self) -> None:
        if not self._recent:
            self._handshake_s = self._transfer_s = 0.0
            return
        self._handshake_s = _lowest((h for _, h, _ in self._recent), HANDSHAKE_QUANTILE)
        self._transfer_s = statistics.median(t for _, _, t in self._recent)

    def signals(
        self,
        queued_tokens: int,
        prefilling: Iterable[Request],
        cost: ForwardCost | None,
        num_arrived_tokens: int = 0,
    ) -> CostSignals:
        """``cost``: the recent forwards' fit (``ForwardClock``); ``num_arrived_tokens``:
        prompt tokens submitted since start."""
        now = self._clock()
        self._age_out(now)
        running = sum(r.num_prompt_tokens - r.num_computed_tokens for r in prefilling)
        rate, forward_s = None, 0.0
        if cost is not None and cost.seconds_per_token > 0:
            rate, forward_s = 1.0 / cost.seconds_per_token, cost.forward_s
        return CostSignals(
            queued_tokens=queued_tokens,
            running_tokens=running,
            prefill_rate_tps=rate,
            handshake_s=self._handshake_s,
            transfer_s=self._transfer_s,
            forward_s=forward_s,
            arrival_tps=self._arrivals.observe(now, num_arrived_tokens),
            chunk_size=self._shape[0],
            max_batch_tokens=self._shape[1],
        )
