"""The hand-off of a prefill to its decode, and optimistic prefill (``Handoff``).

A request's pages go to its decode only once the decode has claimed the room (its `want`,
``Request.is_claimed``). Without optimistic prefill a request is admitted only then, and each
chunk's pages are pushed as it is computed. With ``scheduler.optimistic_prefill`` a request is
also admitted before its want, up to ``scheduler.optimistic_attempts`` times::

    want before or during the prefill   ``claim``: the pages computed so far are pushed at
                                        once, the rest chunk by chunk as before
    prefill done, no want yet           ``hold``: pages and aux row kept, the first token
                                        kept; the want then pushes everything (``claim``)
    held past optimistic_hold_s, or     ``yield_held``: full pages stay in the prefix cache
    admission short of pages/aux rows   (idle, evictable), the rest is freed, the request
                                        goes back to BOOTSTRAPPING and is queued again if
                                        an attempt is left; its next prefill is a cache hit

A yield is a retry (``Outcome.prefill_retries``). The bootstrap timeout bounds all of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prefill_worker.batch import SampledToken
from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.tables import PageTable, num_pages_for
from prefill_worker.request import RequestState
from prefill_worker.scheduler.deadlines import DeadlineHeap, DeadlineKind
from prefill_worker.scheduler.options import EngineLimits
from prefill_worker.scheduler.queues import RequestQueues
from prefill_worker.scheduler.tracked import Request


class Handoff:
    """Pushes, holds and yields finished prefills; engine thread only."""

    def __init__(
        self,
        queues: RequestQueues,
        table: PageTable,
        aux: AuxPool,
        deadlines: DeadlineHeap,
        clock: Callable[[], float],
        limits: EngineLimits,
    ) -> None:
        self._queues, self._table, self._aux = queues, table, aux
        self._deadlines, self._clock = deadlines, clock
        self.page_size = table.page_size
        self.transfer_timeout_s = limits.transfer_timeout_s
        self.hold_s = limits.optimistic_hold_s
        self.attempts = limits.optimistic_attempts if limits.optimistic_prefill else 0

    def on_submit(self, req: Request) -> None:
        req.attempts_left = self.attempts

    def on_admit(self, req: Request) -> None:
        if not req.is_claimed:
            req.attempts_left -= 1

    def claim(self, req: Request) -> None:
        """The decode's want came while ``req`` was PREFILLING: push what is computed."""
        assert req.sender is not None and not req.is_claimed
        req.num_cached_tokens = req.sender.num_cached_tokens()
        req.ready_time = self._clock()
        self._table.claim(req.request_id)  # its pages are no longer speculative
        num_pages = num_pages_for(req.num_computed_tokens, self.page_size)
        if num_pages:
            self.send(req, 0, num_pages)
        token = req.held_token
        if token is not None:
            self._queues.unhold(req)
            self.end_prefill(req, token)

    def chunk_done(self, req: Request, first_page: int, token: SampledToken | None) -> None:
        """A chunk's pages are complete (and committed); ``token`` when it was the last."""
        assert req.sender is not None
        if req.is_claimed:
            end = num_pages_for(req.num_computed_tokens, self.page_size)
            self.send(req, first_page, end)
        if token is None:
            return
        if req.is_claimed:
            self.end_prefill(req, token)
        else:
            req.held_at, req.held_token = self._clock(), token
            self._queues.hold(req)
            self._deadlines.push(req.held_at + self.hold_s, DeadlineKind.HOLD, req)

    def send(self, req: Request, first_page: int, end: int) -> None:
        """Prompt pages ``[first_page, end)``, with their sliding entries (a windowed
        sliding pool: the window pages, held until the request ends; a prefix hit's start
        with its kept window's)."""
        assert req.sender is not None
        entries = self._table.sliding_entries(req.request_id)  # () without a windowed pool
        req.sender.send_pages(req.page_ids[first_page:end], first_page, entries[first_page:end])

    def end_prefill(self, req: Request, token: SampledToken) -> None:
        """The aux row goes after the last pages; then the request is TRANSFERRING."""
        assert req.sender is not None and req.aux_row is not None
        num_scored = 0 if req.prompt_logprobs is None else len(req.prompt_logprobs)
        assert num_scored == req.num_prompt_logprobs, f"{req.request_id}: {num_scored} logprobs"
        logprob = token.logprob if req.return_logprob else math.nan
        num_computed = req.num_computed_tokens - req.num_prefix_hit_tokens
        row = AuxRow(
            token.token_id,
            logprob,
            req.num_prompt_tokens,
            req.num_cached_tokens,
            num_computed_tokens=num_computed,
        )
        self._aux.write(req.aux_row, row)
        req.sender.send_aux(req.aux_row)
        req.first_token_id = token.token_id
        req.first_token_logprob = token.logprob if req.return_logprob else None
        req.prefill_end_time = now = self._clock()
        self._queues.move(req, RequestState.TRANSFERRING)
        self._deadlines.push(now + self.transfer_timeout_s, DeadlineKind.TRANSFER, req)

    def is_hold_over(self, req: Request, now: float) -> bool:
        return req.held_at is not None and req.held_at + self.hold_s <= now

    def make_room(self) -> bool:
        """Admission is short: the oldest held request yields. False when none is held."""
        req = self._queues.oldest_held()
        if req is None:
            return False
        self.yield_held(req)
        return True

    def yield_held(self, req: Request) -> None:
        """Back to BOOTSTRAPPING: its full pages stay cached, its aux row and the rest go."""
        assert req.aux_row is not None and not req.is_in_forward
        self._aux.free(req.aux_row)
        req.aux_row = None
        self._table.release(req.request_id)
        req.page_ids = ()
        req.num_computed_tokens = req.num_scheduled_tokens = req.num_prefix_hit_tokens = 0
        if req.prompt_logprobs is not None:
            req.prompt_logprobs = []
        req.num_retries += 1
        self._queues.move(req, RequestState.BOOTSTRAPPING)  # unholds; queued if attempts left
