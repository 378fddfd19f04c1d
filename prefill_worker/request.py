"""Request vocabulary shared by ingress, scheduler and daemon: sampling, states, outcomes
(the engine's own record of a request is ``scheduler.tracked.Request``).

Torch-free. The life cycle (docs/architecture.md)::

    BOOTSTRAPPING ──▶ WAITING ──▶ PREFILLING ──▶ TRANSFERRING ──▶ DONE
          │  ▲ └──────── optimistic ──▶│               │
          │  └────────── yield ────────┤               │
          └──────────────┴─────────────┴───────────────┴──▶ FAILED | ABORTED

Every move is checked against ``ALLOWED_EDGES``; terminal states have no way out.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass


class RequestState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.ABORTED})
_LIVE = (
    RequestState.BOOTSTRAPPING,
    RequestState.WAITING,
    RequestState.PREFILLING,
    RequestState.TRANSFERRING,
)

ALLOWED_EDGES: frozenset[tuple[RequestState, RequestState]] = frozenset(
    {
        (RequestState.BOOTSTRAPPING, RequestState.WAITING),
        (RequestState.BOOTSTRAPPING, RequestState.PREFILLING),  # optimistic: before the want
        (RequestState.PREFILLING, RequestState.BOOTSTRAPPING),  # optimistic: yield, requeue
        (RequestState.WAITING, RequestState.PREFILLING),
        (RequestState.PREFILLING, RequestState.TRANSFERRING),
        (RequestState.TRANSFERRING, RequestState.DONE),
    }
    | {(live, end) for live in _LIVE for end in (RequestState.FAILED, RequestState.ABORTED)}
)


class IllegalTransition(AssertionError):
    """An internal invariant broke: a state move outside ``ALLOWED_EDGES``."""


def check_edge(src: RequestState, dst: RequestState) -> None:
    if (src, dst) not in ALLOWED_EDGES:
        raise IllegalTransition(f"{src.value} -> {dst.value} is not an allowed edge")


class OutcomeStatus(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    ABORTED = "aborted"


class FinishReason(enum.Enum):
    """Why a request ended; the label of the outcome counter and the ``error`` code."""

    OK = "ok"
    ABORTED_BY_ROUTER = "aborted_by_router"
    ABORTED_BY_DECODE = "aborted_by_decode"
    ROUTER_GONE = "router_gone"  # the router's connection closed with the request in flight
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    TRANSFER_TIMEOUT = "transfer_timeout"
    TRANSFER_FAILED = "transfer_failed"
    PEER_LOST = "peer_lost"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    DRAINING = "draining"
    ENGINE_ERROR = "engine_error"
    PROMPT_TOO_LONG = "prompt_too_long"  # needs more KV pages than the whole pool has

    @property
    def status(self) -> OutcomeStatus:
        if self is FinishReason.OK:
            return OutcomeStatus.OK
        if self in _ABORTS:
            return OutcomeStatus.ABORTED
        return OutcomeStatus.FAILED


_ABORTS = frozenset(
    {FinishReason.ABORTED_BY_ROUTER, FinishReason.ABORTED_BY_DECODE, FinishReason.ROUTER_GONE}
)


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What a request's push moved, counted over its writes that landed: bytes, NIXL transfer
    requests and their descriptors; with NIXL telemetry captured (``tracing.enabled``), the
    post and transfer durations NIXL measured for them, summed (else None)."""

    bytes: int = 0
    writes: int = 0
    descriptors: int = 0
    nixl_post_s: float | None = None
    nixl_xfer_s: float | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """First-token sampling. ``temperature == 0`` or ``top_k == 1`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def problem(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first out-of-range field, or None when valid."""
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            return "sampling.temperature", "must be a finite number in [0, 100]"
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            return "sampling.top_p", "must be in (0, 1]"
        if self.top_k < 0:
            return "sampling.top_k", "must be >= 0 (0 disables top-k)"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return "sampling.seed", "must be in [0, 2**63)"
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds spent in each phase of one request (``result.timings``, docs/protocol.md part 1)."""

    queue_s: float = 0.0
    bootstrap_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """The one final answer for one request; ingress turns it into a ``result`` message."""

    request_id: str
    status: OutcomeStatus
    reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # the prefix the decode peer already held (not sent)
    first_token_id: int | None = None
    first_token_logprob: float | None = None
    error: str | None = None
    timings: Timings = Timings()
    transfer: TransferStats = TransferStats()  # the sender's writes that landed (KV runs, aux)
    num_prefix_hit_tokens: int = 0  # the prefix this worker's cache held (not computed)
    num_computed_tokens: int = 0  # prompt tokens this worker computed for the request
    # Prompt logprobs, only when asked and ok: the logprob of each prompt token at positions
    # [prompt_logprob_start + 1, num_prompt_tokens), given the tokens before it.
    prompt_logprobs: tuple[float, ...] | None = None
    prefill_retries: int = 0  # optimistic prefills that yielded before the decode claimed it


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The W3C trace context a router sent with a request (``traceparent`` and ``tracestate``
    as given, unparsed: the tracer reads them, and ignores a malformed one as W3C asks)."""

    traceparent: str
    tracestate: str | None = None


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """A validated ``prefill`` as ingress hands it to the engine loop.

    ``request_id`` is unique among the worker's requests in flight: the ingress scopes the
    router's own id by its connection (and maps it back in the reply), so two routers may use
    the same id. ``decode_peer`` names the decode agent allowed to claim the room, if the
    router said. ``prompt_logprob_start`` asks for prompt logprobs (with ``return_logprob``):
    those of the tokens after that position (SGLang's ``logprob_start_len``, whose token at
    the start itself has none); None asks for none. The ingress checked it is in
    ``[0, len(token_ids)]``."""

    request_id: str
    token_ids: Sequence[int]  # in practice array("i"), decoded from packed int32
    sampling: SamplingParams
    return_logprob: bool
    bootstrap_room: int
    arrival_time: float  # time.monotonic() when ingress received it
    deadline_s: float | None = None  # whole-request budget from arrival; None: phase timeouts only
    decode_peer: str | None = None  # the only decode agent that may claim the room; None: any
    prompt_logprob_start: int | None = None  # with return_logprob: prompt logprobs from here
    trace_context: TraceContext | None = None  # the router's, when it sent one


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """The router withdrew a request (or its connection closed); idempotent, unknown ids are
    ignored."""

    request_id: str
    reason: FinishReason = FinishReason.ABORTED_BY_ROUTER


_END_STATE = {
    OutcomeStatus.OK: RequestState.DONE,
    OutcomeStatus.FAILED: RequestState.FAILED,
    OutcomeStatus.ABORTED: RequestState.ABORTED,
}


def end_state(reason: FinishReason) -> RequestState:
    """The terminal state a request ends in for ``reason``."""
    return _END_STATE[reason.status]
