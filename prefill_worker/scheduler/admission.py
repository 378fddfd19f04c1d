"""Builds each forward batch: continue prefilling requests, then admit waiting ones FCFS.

Per batch, at most ``max_batch_tokens`` tokens and one chunk per request (``chunking.py``).
A waiting request starts only when all of its prompt's pages and an aux row are free (no
mid-prefill eviction) and fewer than ``max_running_requests`` are prefilling. Strict FCFS:
when the head of the queue has to wait, everyone behind it waits too.

Claimed work first: a batch takes the chunks of claimed prefilling requests and admits
claimed waiting ones; only a batch with none of them goes to speculative work (optimistic
prefill before the decode's claim), which takes at most ``optimistic_share`` of its tokens,
of the running requests and of the pool's pages, starts nothing new while a claimed request
waits, and evicts no page a claimed request left in the prefix cache (``kv.tables``). A flood
of requests nobody claims then costs a claimed one at most the speculative forward in flight
when it comes, and never its cached prefix.

On admission the prompt is looked up in the prefix cache: the pages of its cached prefix are
shared, and its first chunk starts after them (``Request.num_prefix_hit_tokens``). Idle cached
pages are evicted only when the pages the request needs are not free otherwise. A request
asking for prompt logprobs takes no more of a hit than its logprob start (those positions'
logits are needed), and each of its chunks names the prompt tokens its positions score.
Each chunk names its request's aux row as its state slot (``ChunkPlan.state_slot``): a
hybrid model keeps the request's linear-attention state there, held exactly as long as the
aux row. A chunk whose sender can take its K/V straight from the forward (``MirroringSender``, asked
as the chunk is planned) carries that sender's slots (``ChunkPlan.mirror_slots``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.prefix_cache import PrefixHit
from prefill_worker.kv.tables import PageTable
from prefill_worker.request import RequestState
from prefill_worker.scheduler.chunking import chunk_end, logprob_positions
from prefill_worker.scheduler.queues import RequestQueues
from prefill_worker.scheduler.tracked import Request
from prefill_worker.transfer.base import MirroringSender

OnLookup = Callable[[int, int], None]  # (num_query_tokens, num_hit_tokens), once per admission
MakeRoom = Callable[[], bool]  # frees pages and an aux row if it can (a held prefill yields)
OnAdmit = Callable[[Request], None]


def _no_room() -> bool:
    return False


def _admitted(req: Request) -> None:
    return None


def _ignore(num_query_tokens: int, num_hit_tokens: int) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    plan: BatchPlan
    requests: tuple[Request, ...]  # requests[i] owns plan.chunks[i]


class Admission:
    """Turns the queues into the next ``BatchPlan``; reserves pages and aux rows on admit."""

    def __init__(
        self,
        queues: RequestQueues,
        table: PageTable,
        aux: AuxPool,
        clock: Callable[[], float],
        *,
        chunk_size: int,
        max_batch_tokens: int,
        max_running_requests: int,
        on_lookup: OnLookup = _ignore,
        make_room: MakeRoom = _no_room,
        on_admit: OnAdmit = _admitted,
        optimistic_share: float = 1.0,
    ) -> None:
        if chunk_size < table.page_size or max_batch_tokens < table.page_size:
            raise ValueError(
                f"chunk_size ({chunk_size}) and max_batch_tokens ({max_batch_tokens}) must be "
                f">= page_size ({table.page_size}): non-final chunks end on a page boundary"
            )
        self._queues, self._table, self._aux, self._clock = queues, table, aux, clock
        self.page_size = table.page_size
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        self._on_lookup = on_lookup
        self._make_room, self._on_admit = make_room, on_admit
        self._num_batches = 0
        # speculative work's share (at least a page of tokens, one request, one prompt page)
        self._spec_tokens = max(table.page_size, int(max_batch_tokens * optimistic_share))
        self._spec_running = max(1, int(max_running_requests * optimistic_share))
        self._spec_pages = max(1, int(table.pool.num_pages * optimistic_share))

    def next_batch(self) -> ScheduledBatch | None:
        chunks: list[ChunkPlan] = []
        owners: list[Request] = []
        budget = self.max_batch_tokens
        prefilling = self._queues.prefilling
        claimed = [req for req in prefilling.values() if req.is_claimed]
        budget = self._continue(claimed, budget, chunks, owners)
        self._admit(self._queues.head_waiting, budget, chunks, owners)
        if chunks:  # speculative work only fills forwards no claimed work needs
            return self._scheduled(chunks, owners)
        # up to its share; no new request while a claimed one waits (for pages, say), what
        # runs goes on (read after the admissions: a held one may have yielded to them)
        unclaimed = [req for req in prefilling.values() if not req.is_claimed]
        budget = self._continue(unclaimed, self._spec_tokens, chunks, owners)
        if self._queues.head_waiting() is None:
            self._admit(self._speculative_head, budget, chunks, owners)
        return self._scheduled(chunks, owners) if chunks else None

    def _scheduled(self, chunks: list[ChunkPlan], owners: list[Request]) -> ScheduledBatch:
        self._num_batches += 1
        return ScheduledBatch(BatchPlan(self._num_batches, tuple(chunks)), tuple(owners))

    def _continue(
        self, reqs: list[Request], budget: int, chunks: list[ChunkPlan], owners: list[Request]
    ) -> int:
        """The next chunk of each prefilling request in ``reqs`` while the budget lasts."""
        for req in reqs:
            chunk = self._next_chunk(req, budget) if budget > 0 else None
            if chunk is not None:
                chunks.append(chunk)
                owners.append(req)
                budget -= chunk.num_tokens
        return budget

    def _admit(
        self,
        head: Callable[[], Request | None],
        budget: int,
        chunks: list[ChunkPlan],
        owners: list[Request],
    ) -> None:
        """Admit ``head()`` while the budget lasts and it can start; its first chunk."""
        while budget > 0 and self._can_start_more():
            admitted = self._try_admit(head, budget)
            if admitted is None:
                break
            chunk = self._next_chunk(admitted, budget)
            assert chunk is not None
            chunks.append(chunk)
            owners.append(admitted)
            budget -= chunk.num_tokens

    def _speculative_head(self) -> Request | None:
        """The head of the speculative queue while speculative work is under its share of
        the running requests and of the pages."""
        queues = self._queues
        num_running = sum(1 for r in queues.prefilling.values() if not r.is_claimed)
        num_running -= len(queues.held)
        if num_running >= self._spec_running:
            return None
        if self._table.num_speculative_pages() >= self._spec_pages:
            return None
        return queues.head_speculative()

    def _can_start_more(self) -> bool:
        return self._queues.num_running < self.max_running_requests

    def _next_chunk(self, req: Request, budget: int) -> ChunkPlan | None:
        start, num_tokens = req.num_scheduled_tokens, req.num_prompt_tokens
        if start >= num_tokens:
            return None
        end = chunk_end(start, num_tokens, min(self.chunk_size, budget), self.page_size)
        if end is None:
            return None
        req.num_scheduled_tokens = end
        sampling = req.sampling if end == num_tokens else None
        tokens = req.token_ids[start:end]
        mirror = _mirror_slots(req, start, end)
        chunk = ChunkPlan(
            req.request_id,
            tokens,
            start,
            end,
            req.page_ids,
            sampling,
            mirror_slots=mirror,
            state_slot=req.aux_row,
            next_token_id=req.token_ids[end] if end < num_tokens else None,
            sliding_page_ids=self._table.sliding_pages_for(req.request_id, start, end),
        )
        scored = logprob_positions(req.prompt_logprob_start, start, end, num_tokens)
        if not scored:
            return chunk
        targets = req.token_ids[scored.start + 1 : scored.stop + 1]
        return dataclasses.replace(chunk, logprob_from=scored.start, logprob_token_ids=targets)

    def _try_admit(self, head: Callable[[], Request | None], budget: int) -> Request | None:
        """The head of a queue, moved to PREFILLING with its pages and aux row; while they
        are short, held prefills yield theirs to a claimed request (``make_room``)."""
        req = head()
        if req is None:
            return None
        speculative = req.state is RequestState.BOOTSTRAPPING  # not claimed yet
        while True:
            hit = self._table.lookup(req.token_ids, req.max_prefix_hit_tokens)
            limit = min(self.chunk_size, budget)
            if chunk_end(hit.num_tokens, req.num_prompt_tokens, limit, self.page_size) is None:
                return None
            if self._try_start(req, hit, speculative):
                break
            if speculative or not self._make_room():
                return None
        self._on_lookup(hit.num_query_tokens, hit.num_tokens)
        return req

    def _try_start(self, req: Request, hit: PrefixHit, speculative: bool) -> bool:
        aux_row = self._aux.try_alloc()
        if aux_row is None:
            return False
        page_ids = self._table.try_reserve(req.request_id, req.token_ids, hit, speculative)
        if page_ids is None:
            self._aux.free(aux_row)
            return False
        self._queues.pop_admitted(req)
        self._on_admit(req)
        req.page_ids, req.aux_row, req.prefill_start_time = page_ids, aux_row, self._clock()
        req.num_prefix_hit_tokens = req.num_computed_tokens = hit.num_tokens
        req.num_scheduled_tokens = hit.num_tokens
        self._queues.move(req, RequestState.PREFILLING)
        return True


def _mirror_slots(req: Request, start: int, end: int) -> Sequence[int]:
    """Where the forward also writes positions [start, end): the sender's say (it knows
    whether it has a destination yet), () for a sender that never mirrors."""
    sender = req.sender
    return sender.mirror_slots(start, end) if isinstance(sender, MirroringSender) else ()
