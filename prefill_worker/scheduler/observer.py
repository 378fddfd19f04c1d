"""What the engine tells the rest of the process: outcomes, step timings and its load.

``OutcomeSink`` takes the one final ``Outcome`` per request (ingress turns it into a
``result``). ``EngineObserver`` is the metrics seam (outcomes, steps, forwards, load, and
every state move of a live request); ``NullObserver`` is the no-op default. The load itself
(``LoadSnapshot``) is shared vocabulary, in ``prefill_worker.load``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prefill_worker.batch import BatchPlan
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import Outcome, RequestState

OutcomeSink = Callable[[Outcome], None]


class EngineObserver(Protocol):
    """Called on the engine thread; implementations must be quick and must not raise."""

    def on_outcome(self, outcome: Outcome) -> None:
        """Once per request, just before the outcome goes to the sink."""
        ...

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        """After each turn that launched or consumed a forward batch."""
        ...

    def on_load(self, load: LoadSnapshot) -> None:
        """After a turn that changed the load (queue sizes, pages, aux rows)."""
        ...

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        """After each forward batch was collected: it ran from ``started_at`` to ``ended_at``
        (the engine's clock) and computed every chunk of ``plan`` (request traces' chunks)."""
        ...

    def on_transition(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        """After each state move of a live request (an allowed edge; ``dst`` may be terminal).
        Called once per move, so it must be cheap."""
        ...

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Once per admitted request: its prompt was looked up in the prefix cache
        (``num_query_tokens`` is 0 when the cache is off) and ``num_hit_tokens`` were found."""
        ...


class NullObserver:
    """Observes nothing."""

    def on_outcome(self, outcome: Outcome) -> None:
        return None

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        return None

    def on_load(self, load: LoadSnapshot) -> None:
        return None

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        return None

    def on_transition(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        return None

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        return None
