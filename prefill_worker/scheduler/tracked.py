"""One prefill as the engine loop tracks it (``Request``): its state, pages, progress, first
token, timings, and the outcome it ends with. Mutable, owned by the engine thread only; the
vocabulary it is made of (states and their edges, outcomes) is ``prefill_worker.request``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefill_worker.request import (
    ALLOWED_EDGES,
    FinishReason,
    Outcome,
    PrefillRequest,
    RequestState,
    Timings,
    TransferStats,
    check_edge,
)

NO_TRANSFER = TransferStats()  # nothing landed

if TYPE_CHECKING:
    from prefill_worker.batch import SampledToken
    from prefill_worker.transfer.base import KVSender

_ALLOWED_EDGE_IDS = frozenset((id(src), id(dst)) for src, dst in ALLOWED_EDGES)


class Request:
    """One prefill as the engine loop tracks it: mutable, owned by the engine thread only.

    ``num_computed_tokens`` is how far the prompt's K/V is in its pages: it starts at
    ``num_prefix_hit_tokens`` (pages the prefix cache supplied) when the request is admitted.
    ``num_scheduled_tokens`` runs ahead of it while a chunk is in a forward batch;
    ``is_in_forward`` says a launched batch may still write its pages. Phase timestamps are
    ``time.monotonic()`` values, None until the phase is reached.

    ``prompt_logprob_start`` is set only when the request asked for prompt logprobs (the
    engine's rule: they are computed and reported only when asked); ``prompt_logprobs`` then
    collects them chunk by chunk, else it stays None.
    """

    __slots__ = (
        "arrival_time",
        "attempts_left",
        "aux_row",
        "deadline_s",
        "decode_peer",
        "finish_time",
        "first_token_id",
        "first_token_logprob",
        "held_at",
        "held_token",
        "is_in_forward",
        "is_queued",
        "is_speculating",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prefix_hit_tokens",
        "num_retries",
        "num_scheduled_tokens",
        "page_ids",
        "prefill_end_time",
        "prefill_start_time",
        "prompt_logprob_start",
        "prompt_logprobs",
        "ready_time",
        "request_id",
        "return_logprob",
        "room",
        "sampling",
        "sender",
        "state",
        "token_ids",
    )

    def __init__(self, message: PrefillRequest, sender: KVSender | None) -> None:
        self.request_id = message.request_id
        self.token_ids = message.token_ids
        self.sampling = message.sampling
        self.return_logprob = message.return_logprob
        self.room = message.bootstrap_room
        self.arrival_time = message.arrival_time
        self.deadline_s = message.deadline_s
        self.decode_peer = message.decode_peer
        start = message.prompt_logprob_start if message.return_logprob else None
        self.prompt_logprob_start = start
        self.prompt_logprobs: list[float] | None = None if start is None else []
        self.sender = sender
        self.state = RequestState.BOOTSTRAPPING
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_cached_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.page_ids: tuple[int, ...] = ()
        self.aux_row: int | None = None
        self.is_in_forward = False
        self.first_token_id: int | None = None
        self.first_token_logprob: float | None = None
        self.ready_time: float | None = None
        self.prefill_start_time: float | None = None
        self.prefill_end_time: float | None = None
        self.finish_time: float | None = None
        # optimistic prefill (``scheduler.handoff``): admissions left before the decode asks,
        # yields so far, and a finished prefill held for its want (since, and its first token)
        self.attempts_left = 0
        self.num_retries = 0
        self.is_queued = False  # in the admission queue (``RequestQueues.waiting``)
        self.is_speculating = False  # in ``RequestQueues.speculative``
        self.held_at: float | None = None
        self.held_token: SampledToken | None = None

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.state.value}, {self.num_prompt_tokens} tok)"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_logprobs(self) -> int:
        """How many prompt logprobs the request asked for: positions ``[start, n - 1)`` each
        give the next token's (position ``n - 1`` gives the first token)."""
        if self.prompt_logprob_start is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - self.prompt_logprob_start)

    @property
    def max_prefix_hit_tokens(self) -> int | None:
        """The longest prefix the cache may supply: the positions whose logits give prompt
        logprobs must be computed (SGLang limits its prefix match the same way)."""
        return self.prompt_logprob_start

    @property
    def is_claimed(self) -> bool:
        """Its decode has asked (sent its want): pages may be pushed to it."""
        return self.ready_time is not None

    @property
    def is_admissible(self) -> bool:
        """Admission may start it: its decode asked, or an optimistic attempt is left."""
        state = self.state
        return state is RequestState.WAITING or (
            state is RequestState.BOOTSTRAPPING and self.attempts_left > 0
        )

    def move_to(self, state: RequestState) -> None:
        """The only way a request changes state; raises ``IllegalTransition`` off the table."""
        if (id(self.state), id(state)) not in _ALLOWED_EDGE_IDS:  # Enum.__hash__ is slow
            check_edge(self.state, state)
        self.state = state

    def timings(self, now: float) -> Timings:
        """Seconds per phase; a phase not reached is 0, the current one runs until ``now``.
        A phase starts when the one before it ended: a prefill that ran before its decode
        asked (optimistic) counts only from the want on, so the phases add up to the total."""
        marks = (
            self.arrival_time,
            self.ready_time,
            self.prefill_start_time,
            self.prefill_end_time,
            self.finish_time,
        )
        spans = [0.0, 0.0, 0.0, 0.0]
        begin = marks[0]
        for phase in range(4):
            end = marks[phase + 1]
            spans[phase] = max(0.0, (now if end is None else end) - begin)
            if end is None:
                break
            begin = max(begin, end)
        bootstrap_s, queue_s, prefill_s, transfer_s = spans
        return Timings(
            queue_s=queue_s,
            bootstrap_s=bootstrap_s,
            prefill_s=prefill_s,
            transfer_s=transfer_s,
        )

    def outcome(
        self,
        reason: FinishReason,
        error: str | None,
        now: float,
        transfer: TransferStats = NO_TRANSFER,
    ) -> Outcome:
        """The final answer for this request; the first token only when it succeeded."""
        is_ok = reason is FinishReason.OK
        return Outcome(
            request_id=self.request_id,
            status=reason.status,
            reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens,
            num_computed_tokens=self.num_computed_tokens - self.num_prefix_hit_tokens,
            first_token_id=self.first_token_id if is_ok else None,
            first_token_logprob=self.first_token_logprob if is_ok else None,
            prompt_logprobs=_frozen(self.prompt_logprobs) if is_ok else None,
            error=error,
            timings=self.timings(now),
            transfer=transfer,
            prefill_retries=self.num_retries,
        )


def _frozen(values: list[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)
