"""The worker's load, as the engine publishes it and the ingress, the HTTP front and the
metrics read it.

``LoadSnapshot`` is immutable and swapped whole at the end of an engine turn (and after
planning, while a forward is in flight), so any thread
may read the latest one (the ingress ``pong``, ``/readyz``, the HTTP front's ``/v1/loads``)
without a lock.
``LoadSource`` is how a reader is handed it: a callable returning the latest snapshot
(``Engine.load`` in the daemon, a constant in tests). Shared vocabulary: the ingress reads it
without importing the scheduler.

The cost signals (``CostSignals``) are the scheduler's numbers (``scheduler.costs``); the
one formula built on them, the predicted TTFT of a new request, is here so that every reader
(metrics, ``/v1/loads``, ``pong``, the SLO admission of both fronts) applies the same one.
A forward of ``t`` tokens costs ``d(t) = forward_s + t / prefill_rate_tps`` (0 for none);
with ``Q`` queued and ``R`` running tokens, ``B`` = max_batch_tokens and ``C`` = chunk_size::

    flight           = min(R, B)                  tokens of the forward in flight
    ahead            = Q + R − flight             work that is not in it
    next             = min(ahead, B)              the forward planned next
    shared           = ahead − next               work that shares the new request's forwards
    K                = max(⌈(shared + n) / B⌉, ⌈n / C⌉)
    wait_s           = max(handshake_s, d(flight) / 2 + d(next))
    joined(n)        = min(arrival_tps · d(flight), K · B − shared − n)
    predicted_ttft_s = wait_s + K · forward_s + (shared + n + joined(n)) / rate + transfer_s

The engine plans its next forward before it waits for the one in flight, and takes new
requests only between forwards (``scheduler.engine``): a request that arrives while a forward
runs waits for the rest of it (half of it, on average: arrivals do not know its phase), then
for the forward already planned, and its first chunk goes in the forward after, which it
shares with whatever of the backlog is left (FCFS, ``B`` tokens and one ``C``-token chunk per
request a forward): ``K`` forwards carry that and its ``n`` uncached tokens. The requests that
arrived during the forward in flight are taken with it and join its forwards while they have
room. Its handshake runs while it waits (hence the max; an idle worker takes it at once). Then
the push of its last chunk and its answer. None while no forward has been measured yet (a cold
worker: nothing to predict from). An unknown batch shape (``chunk_size`` or
``max_batch_tokens`` 0, from an older worker's ``pong``) puts any amount of work in one
forward, with no room.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from prefill_worker.request import RequestState


@dataclass(frozen=True, slots=True)
class CostSignals:
    """What the queued and running work costs, in tokens and seconds (``scheduler.costs``)."""

    queued_tokens: int = 0  # prompt tokens of BOOTSTRAPPING and WAITING requests
    running_tokens: int = 0  # tokens PREFILLING requests have yet to compute (hits excluded)
    prefill_rate_tps: float | None = None  # tokens/s a forward adds per token; None: none yet
    handshake_s: float = 0.0  # the lowest tenth of recent bootstrap waits: the handshake
    transfer_s: float = 0.0  # median last-chunk-to-answer time of the same requests
    forward_s: float = 0.0  # what one forward costs whatever its tokens (the fit's intercept)
    arrival_tps: float = 0.0  # prompt tokens arriving per second, recently
    chunk_size: int = 0  # the worker's scheduler.chunk_size; 0: unknown
    max_batch_tokens: int = 0  # the worker's scheduler.max_batch_tokens; 0: unknown

    @property
    def backlog_s(self) -> float | None:
        """Seconds to compute what is queued and running; 0 when idle, None when unknown."""
        work = self.queued_tokens + self.running_tokens
        if work == 0:
            return 0.0
        if self.prefill_rate_tps is None:
            return None
        return self._forwards(work, self.max_batch_tokens) * self.forward_s + (
            work / self.prefill_rate_tps
        )

    def predicted_ttft_s(self, num_tokens: int) -> float | None:
        """The TTFT a new request of ``num_tokens`` uncached tokens would see (module doc)."""
        rate, size = self.prefill_rate_tps, self.max_batch_tokens
        if rate is None:  # no forward measured yet: nothing to predict from
            return None
        work = self.queued_tokens + self.running_tokens
        flight = min(self.running_tokens, size or self.running_tokens)
        planned = min(work - flight, size or work)
        shared = work - flight - planned
        flight_s = self._batch_s(flight, rate)
        wait_s = max(self.handshake_s, flight_s / 2 + self._batch_s(planned, rate))
        num_forwards = max(
            self._forwards(shared + num_tokens, size),
            self._forwards(num_tokens, self.chunk_size),
        )
        room = num_forwards * size - shared - num_tokens if size else 0
        joined = min(self.arrival_tps * flight_s, room)
        compute_s = num_forwards * self.forward_s + (shared + num_tokens + joined) / rate
        return wait_s + compute_s + self.transfer_s

    def _batch_s(self, num_tokens: int, rate: float) -> float:
        """One forward of ``num_tokens`` (none: 0)."""
        return self.forward_s + num_tokens / rate if num_tokens else 0.0

    @staticmethod
    def _forwards(num_tokens: int, per_forward: int) -> int:
        """Forwards of at most ``per_forward`` tokens (0: unknown, one) that ``num_tokens`` take."""
        if num_tokens == 0:
            return 0
        return math.ceil(num_tokens / per_forward) if per_forward else 1


TTFT_SLO_REJECT = "ttft_slo"  # the rejects counter's label value for an SLO refusal


def ttft_slo_refusal(costs: CostSignals, num_tokens: int, slo_s: float | None) -> str | None:
    """Why a request of ``num_tokens`` is refused under ``admission.ttft_slo_s``, or None.
    No SLO, no prediction yet (a cold worker), or an idle worker (nothing queued or running:
    refusing cannot make anything faster, and what it serves refreshes the signals):
    admitted."""
    if slo_s is None or costs.queued_tokens + costs.running_tokens == 0:
        return None
    predicted_s = costs.predicted_ttft_s(num_tokens)
    if predicted_s is None or predicted_s <= slo_s:
        return None
    return f"predicted TTFT {predicted_s:.3f} s exceeds the SLO of {slo_s:.3f} s"


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """Requests per live state and KV pages, as the engine last published them."""

    num_bootstrapping: int = 0
    num_waiting: int = 0
    num_prefilling: int = 0
    num_transferring: int = 0
    num_free_pages: int = 0  # free, or held only by the prefix cache (evicted on demand)
    num_total_pages: int = 0
    num_free_aux_rows: int = 0
    num_total_aux_rows: int = 0
    num_cached_pages: int = 0  # held by the prefix cache (in use by requests or idle)
    num_used_sliding_pages: int = 0  # a windowed sliding pool's (``kv.sliding``), held
    costs: CostSignals = CostSignals()

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
