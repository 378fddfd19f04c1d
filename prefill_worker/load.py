"""The worker's load, as the engine publishes it and the ingress, the HTTP front and the
metrics read it.

``LoadSnapshot`` is immutable and swapped whole at the end of an engine turn, so any thread
may read the latest one (the ingress ``pong``, ``/readyz``, the HTTP front's ``/v1/loads``)
without a lock.
``LoadSource`` is how a reader is handed it: a callable returning the latest snapshot
(``Engine.load`` in the daemon, a constant in tests). Shared vocabulary: the ingress reads it
without importing the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefill_worker.request import RequestState


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


LoadSource = Callable[[], LoadSnapshot]  # returns the latest snapshot; any thread may call it
