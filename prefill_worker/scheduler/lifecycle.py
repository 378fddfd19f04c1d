"""Every live request from ``submit`` to its one ``Outcome``, on the engine thread.

``RequestLifecycle`` owns the request queues, the deadline heap and the pages of ended
requests that a running forward may still write. The engine's loop calls it each turn::

    submit          a prefill (sender created, deadlines pushed) or an abort
    poll_senders    the claimed rooms' senders (the backend names them), a few more
                    bootstrap/waiting ones; every prefilling and transferring one
    expire          deadlines that passed (bootstrap, transfer, per request)
    send_prefix_hits  a launched batch's new requests: their cached pages → send_pages
    consume         a collected forward: pages → prefix cache; its hand-off to the decode
                    (pushed, or held until the want: ``handoff.Handoff``)

Every request ends through ``finish``: sender failed (if need be) and closed, pages and aux
row freed (those a running forward still writes by ``release_deferred`` when it is
collected, and so is the close of a sender whose destination that forward writes: a
``MirroringSender``), one ``Outcome`` counted, observed and handed to the sink.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from prefill_worker.batch import BatchOutput, ChunkPlan, SampledToken
from prefill_worker.inbox import EngineMessage
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.tables import Detached, PageTable, num_pages_for
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    RequestState,
    end_state,
)
from prefill_worker.scheduler.admission import ScheduledBatch
from prefill_worker.scheduler.deadlines import DeadlineHeap, DeadlineKind
from prefill_worker.scheduler.handoff import Handoff
from prefill_worker.scheduler.observer import EngineObserver, OutcomeSink
from prefill_worker.scheduler.options import EngineLimits
from prefill_worker.scheduler.queues import RequestQueues
from prefill_worker.scheduler.tracked import Request
from prefill_worker.transfer.base import KVPoll, KVSender, MirroringSender, TransferBackend

log = logging.getLogger(__name__)

_SENDER_END = {
    KVPoll.FAILED: FinishReason.TRANSFER_FAILED,
    KVPoll.ABORTED: FinishReason.ABORTED_BY_DECODE,
    KVPoll.PEER_LOST: FinishReason.PEER_LOST,
}
_ABORT_ERRORS = {
    FinishReason.ABORTED_BY_ROUTER: "aborted by the router",
    FinishReason.ROUTER_GONE: "the router's connection closed",
}


class RequestLifecycle:
    """The live requests and the one way out; engine thread only."""

    def __init__(
        self,
        transfer: TransferBackend,
        table: PageTable,
        aux: AuxPool,
        sink: OutcomeSink,
        observer: EngineObserver,
        clock: Callable[[], float],
        limits: EngineLimits,
    ) -> None:
        self._transfer, self._table, self._aux = transfer, table, aux
        self._sink, self._observer, self._clock = sink, observer, clock
        self.queues = RequestQueues(observer.on_transition)
        self.deadlines = DeadlineHeap()
        self.page_size = table.page_size
        self.bootstrap_timeout_s = limits.bootstrap_timeout_s
        self.transfer_timeout_s = limits.transfer_timeout_s
        self._poll_budget = limits.poll_budget
        self._claimed: dict[str, Request] = {}  # claimed, still BOOTSTRAPPING: looked at each turn
        # pages of ended requests a forward may write, and whether they were claimed (trusted)
        self._deferred: list[tuple[Detached, bool]] = []
        self._unclosed: list[KVSender] = []  # their senders whose destination it may write
        self.handoff = Handoff(self.queues, table, aux, self.deadlines, clock, limits)
        self.outcome_counts: Counter[FinishReason] = Counter()

    def submit(self, message: EngineMessage) -> None:
        """Take one message. Ids are unique among live requests, prompts are not empty and a
        prompt-logprob start is within the prompt: the ingress owns these policies (it scopes
        router ids by connection, rejects duplicates, empty prompts and starts beyond the
        prompt), so the engine trusts them."""
        if isinstance(message, AbortRequest):
            req = self.queues.live.get(message.request_id)
            if req is not None:
                error = _ABORT_ERRORS.get(message.reason, message.reason.value)
                self.finish(req, message.reason, error)
            return
        assert message.request_id not in self.queues.live, f"{message.request_id!r} is live"
        assert message.token_ids, f"{message.request_id!r} has an empty prompt"
        num_tokens = len(message.token_ids)
        start = message.prompt_logprob_start
        assert start is None or 0 <= start <= num_tokens, f"{message.request_id!r}: {start}"
        trace = message.trace_context
        sender = self._transfer.create_sender(
            message.bootstrap_room,
            message.request_id,
            num_tokens,
            allowed_peer=message.decode_peer,
            traceparent=None if trace is None else trace.traceparent,
        )
        req = Request(message, sender)
        self.handoff.on_submit(req)
        self.queues.add(req)
        if not self._table.can_ever_fit(num_tokens):
            need = num_pages_for(num_tokens, self.page_size)
            self.finish(
                req,
                FinishReason.PROMPT_TOO_LONG,
                f"{num_tokens} tokens need {need} KV pages; the pool has "
                f"{self._table.pool.num_pages}",
            )
        else:
            self.deadlines.push(
                req.arrival_time + self.bootstrap_timeout_s, DeadlineKind.BOOTSTRAP, req
            )
            if req.deadline_s is not None:
                self.deadlines.push(req.arrival_time + req.deadline_s, DeadlineKind.REQUEST, req)
            self._check_sender(req)  # a claim that came first, or a refusal: seen now

    def poll_senders(self) -> None:
        """Per turn: the senders of rooms claimed since the last turn (and of the claimed ones
        still bootstrapping), ``poll_budget`` more of the unclaimed ones round-robin (for their
        failures: what no claim reports), the head of the admission queue, every running one.
        The work grows with what happens, not with how many wait for their decode."""
        by_room = self.queues.by_room
        for room in self._transfer.take_claimed_rooms():
            for req in by_room.get(room, ()):
                if req.state is RequestState.BOOTSTRAPPING:
                    self._claimed[req.request_id] = req
        for req in list(self._claimed.values()):
            self._check_sender(req)
            if req.state is not RequestState.BOOTSTRAPPING:
                del self._claimed[req.request_id]
        for req in self.queues.next_watched(self._poll_budget):
            self._check_sender(req)
        head = self.queues.head_waiting()
        if head is not None:
            self._check_sender(head)  # admission next: catch an abort or failure first
        for req in list(self.queues.prefilling.values()):
            self._check_sender(req)
        self.poll_transferring()

    def poll_transferring(self) -> None:
        """Only the requests whose prefill is over (TRANSFERRING): no batch holds them, so
        they may end while a forward runs (``Engine`` calls this then)."""
        for req in list(self.queues.inflight.values()):
            self._check_sender(req)

    def _check_sender(self, req: Request) -> None:
        assert req.sender is not None
        if req.state.is_terminal:
            return  # ended earlier in this turn
        try:
            status = req.sender.poll()
        except AssertionError:
            raise  # a broken invariant is shared state: the engine stops
        except Exception as exc:  # this request's transfer: it fails, the engine goes on
            log.exception("request %s: its sender failed", req.request_id)
            return self.finish(req, FinishReason.ENGINE_ERROR, f"engine error: {exc!r}")
        if status is KVPoll.READY:
            if req.state is RequestState.BOOTSTRAPPING:
                req.num_cached_tokens = req.sender.num_cached_tokens()
                req.ready_time = self._clock()
                self.queues.move(req, RequestState.WAITING)
            elif req.state is RequestState.PREFILLING and not req.is_claimed:
                self._guarded(req, self.handoff.claim, req)  # optimistic: the want came now
        elif status is KVPoll.SUCCESS:
            if req.state is RequestState.TRANSFERRING:
                self.finish(req, FinishReason.OK, None)
        elif status in _SENDER_END:
            reason = req.sender.failure_reason() or f"sender {status.value}"
            self.finish(req, _SENDER_END[status], reason)

    def expire(self) -> None:
        now = self._clock()
        for kind, req in self.deadlines.pop_expired(now):
            if kind is DeadlineKind.BOOTSTRAP and not (req.is_claimed or req.state.is_terminal):
                # No room in the text: it is logged, and rooms are capabilities.
                error = f"no handshake from the decode peer within {self.bootstrap_timeout_s}s"
                hint = None if req.sender is None else req.sender.why_no_handshake()
                error = error if hint is None else f"{error}; {hint}"
                self.finish(req, FinishReason.BOOTSTRAP_TIMEOUT, error)
            elif kind is DeadlineKind.TRANSFER and req.state is RequestState.TRANSFERRING:
                error = f"KV transfer did not finish within {self.transfer_timeout_s}s"
                self.finish(req, FinishReason.TRANSFER_TIMEOUT, error)
            elif kind is DeadlineKind.HOLD and self.handoff.is_hold_over(req, now):
                self.handoff.yield_held(req)
            elif kind is DeadlineKind.REQUEST and not req.state.is_terminal:
                error = f"request deadline of {req.deadline_s}s passed while {req.state.value}"
                self.finish(req, FinishReason.DEADLINE_EXCEEDED, error)

    def send_prefix_hits(self, batch: ScheduledBatch) -> None:
        """Push the cached pages of requests whose first computed chunk was just launched."""
        for chunk, req in zip(batch.plan.chunks, batch.requests, strict=True):
            is_first = chunk.start == req.num_prefix_hit_tokens > 0
            if is_first and req.is_claimed and not req.state.is_terminal:
                self._guarded(req, self._send_hit, req)

    def _send_hit(self, req: Request) -> None:
        self.handoff.send(req, 0, req.num_prefix_hit_tokens // self.page_size)

    def consume(self, batch: ScheduledBatch, output: BatchOutput) -> None:
        sampled = {token.request_id: token for token in output.sampled}
        scored = {lp.request_id: lp.logprobs for lp in output.prompt_logprobs}
        for chunk, req in zip(batch.plan.chunks, batch.requests, strict=True):
            if req.state is not RequestState.PREFILLING:
                continue  # ended while its chunk was computing
            if req.prompt_logprobs is not None:
                logprobs = scored.get(req.request_id, ())
                assert len(logprobs) == len(chunk.logprob_token_ids), req.request_id
                req.prompt_logprobs.extend(logprobs)  # chunks are consumed in prompt order
            self._guarded(req, self._consume_chunk, chunk, req, sampled.get(req.request_id))

    def _guarded(self, req: Request, action: Callable[..., None], *args: object) -> None:
        """``action(*args)`` for one request: if it raises, that request fails, not the engine."""
        try:
            action(*args)
        except AssertionError:
            raise  # a broken invariant is shared state: the engine stops
        except Exception as exc:  # this request's own data: it fails, the engine goes on
            log.exception("request %s failed while its batch was handled", req.request_id)
            if not req.state.is_terminal:
                self.finish(req, FinishReason.ENGINE_ERROR, f"engine error: {exc!r}")

    def _consume_chunk(self, chunk: ChunkPlan, req: Request, token: SampledToken | None) -> None:
        req.num_computed_tokens = chunk.end
        # its full pages are complete (shareable); sliding pages before its window go back
        self._table.chunk_done(req.request_id, chunk.end)
        if chunk.sampling is None:
            return self.handoff.chunk_done(req, chunk.start // self.page_size, None)
        assert token is not None, f"no sampled token for {req.request_id!r}"
        if token.error is not None:
            self.finish(req, FinishReason.ENGINE_ERROR, f"sampling failed: {token.error}")
        else:
            self.handoff.chunk_done(req, chunk.start // self.page_size, token)

    def release_deferred(self) -> None:
        """Close the senders and free the pages of requests that ended while a forward used
        them (it was collected)."""
        for sender in self._unclosed:
            sender.close()
        self._unclosed.clear()
        for detached, trusted in self._deferred:
            self._table.free_detached(detached, trusted)
        self._deferred.clear()

    def fail_all(self, reason: FinishReason, error: str) -> None:
        for req in list(self.queues.live.values()):
            self.finish(req, reason, error)

    def fail_untaken(self, message: EngineMessage, reason: FinishReason, error: str) -> None:
        """A message the engine stopped before taking: submitted, so that a prefill's decode
        hears its room failed (``fail_all`` then fails it); one that cannot be submitted any
        more (the engine broke) still gets its one ``Outcome``, without a sender."""
        try:
            self.submit(message)
        except Exception:
            log.exception("a message left in the inbox could not be submitted")
            live = message.request_id in self.queues.live
            if isinstance(message, AbortRequest) or live:
                return  # fail_all answers a live one; an abort has no reply of its own
            self._emit(Outcome(message.request_id, reason.status, reason, len(message.token_ids),
                               error=error))  # fmt: skip

    # ---- the one way out ----------------------------------------------------------------

    def finish(self, req: Request, reason: FinishReason, error: str | None) -> None:
        assert req.sender is not None
        if reason not in (FinishReason.OK, FinishReason.ABORTED_BY_DECODE):
            req.sender.fail(error or reason.value)
        if req.is_in_forward and isinstance(req.sender, MirroringSender):
            self._unclosed.append(req.sender)  # the forward may write its slots: closed after
        else:
            req.sender.close()  # only now may pages and the aux row be reused
        req.finish_time = self._clock()
        self.queues.move(req, end_state(reason))
        if req.aux_row is not None:
            self._aux.free(req.aux_row)
            req.aux_row = None
        if req.page_ids:
            if req.is_in_forward:
                self._deferred.append((self._table.detach(req.request_id), req.is_claimed))
            else:
                self._table.release(req.request_id)
        transfer = req.sender.transfer_stats()
        self._emit(req.outcome(reason, error, req.finish_time, transfer))

    def _emit(self, outcome: Outcome) -> None:
        self.outcome_counts[outcome.reason] += 1
        self._observer.on_outcome(outcome)
        self._sink(outcome)

    def check_integrity(self) -> None:
        self.queues.check_integrity()
        self._table.check_integrity(detached for detached, _ in self._deferred)
        self._aux.check_integrity()
        held = sum(1 for r in self.queues.live.values() if r.aux_row is not None)
        assert self._aux.num_rows - self._aux.num_free == held
