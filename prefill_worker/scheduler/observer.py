"""What the engine tells the rest of the process: outcomes, step timings and its load.

``OutcomeSink`` takes the one final ``Outcome`` per request (ingress turns it into a
``result``). ``EngineObserver`` is the metrics seam (outcomes, steps, load, and every state
move of a live request); ``NullObserver`` is the no-op default.
``LoadSnapshot`` is immutable and swapped whole, so any thread may read the latest one (the
ingress ``pong``, ``/readyz``) without a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prefill_worker.request import Outcome, RequestState

OutcomeSink = Callable[[Outcome], None]


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """Requests per live state and KV pages, as of the end of one engine turn."""

    num_bootstrapping: int = 0
    num_waiting: int = 0
    num_prefilling: int = 0
    num_transferring: int = 0
    num_free_pages: int = 0  # free, or held only by the prefix cache (evicted on demand)
    num_total_pages: int = 0
    num_free_aux_rows: int = 0
    num_total_aux_rows: int = 0
    num_cached_pages: int = 0  # held by the prefix cache (in use by requests or idle)

    @property
    def num_running(self) -> int:
        return self.num_prefilling

    @property
    def num_live(self) -> int:
        return (
            self.num_bootstrapping + self.num_waiting + self.num_prefilling + self.num_transferring
        )

    @property
    def num_used_pages(self) -> int:
        return self.num_total_pages - self.num_free_pages

    @property
    def num_used_aux_rows(self) -> int:
        return self.num_total_aux_rows - self.num_free_aux_rows

    def queue_sizes(self) -> dict[str, int]:
        """Live requests keyed by ``RequestState.value`` (the metrics ``state`` label)."""
        return {
            RequestState.BOOTSTRAPPING.value: self.num_bootstrapping,
            RequestState.WAITING.value: self.num_waiting,
            RequestState.PREFILLING.value: self.num_prefilling,
            RequestState.TRANSFERRING.value: self.num_transferring,
        }


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

    def on_transition(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        return None

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        return None
