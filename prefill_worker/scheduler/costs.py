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
    prefill_rate     tokens/s over the last ``ForwardClock`` window of forwards (64), measured
                     around the runner: a recent rate that follows the load, not an all-time
                     average. None until the first forward.
    handshake_s      median bootstrap wait (arrival to the decode's want) of the last
                     ``window`` requests that succeeded.
    transfer_s       median time from their last chunk computed to their answer (the push).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

from prefill_worker.load import CostSignals
from prefill_worker.request import Outcome, OutcomeStatus
from prefill_worker.scheduler.tracked import Request


class CostEstimator:
    """Keeps the recent requests' non-compute times; turns the queues into ``CostSignals``.
    Engine thread only."""

    def __init__(self, window: int = 64) -> None:
        self._handshakes: deque[float] = deque(maxlen=window)
        self._transfers: deque[float] = deque(maxlen=window)
        self._handshake_s = 0.0
        self._transfer_s = 0.0

    def on_outcome(self, outcome: Outcome) -> None:
        """A request ended; one that succeeded adds its handshake and push times."""
        if outcome.status is not OutcomeStatus.OK:
            return
        self._handshakes.append(outcome.timings.bootstrap_s)
        self._transfers.append(outcome.timings.transfer_s)
        self._handshake_s = statistics.median(self._handshakes)
        self._transfer_s = statistics.median(self._transfers)

    def signals(
        self, queued_tokens: int, prefilling: Iterable[Request], seconds_per_token: float | None
    ) -> CostSignals:
        """``seconds_per_token``: the forwards' recent average (``ForwardClock``)."""
        running = sum(r.num_prompt_tokens - r.num_computed_tokens for r in prefilling)
        rate = None if not seconds_per_token else 1.0 / seconds_per_token
        return CostSignals(
            queued_tokens=queued_tokens,
            running_tokens=running,
            prefill_rate_tps=rate,
            handshake_s=self._handshake_s,
            transfer_s=self._transfer_s,
        )
