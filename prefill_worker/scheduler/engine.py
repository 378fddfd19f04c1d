"""The engine loop: takes requests, admits and chunks them, runs forwards, pushes KV, replies.

One turn (``step``), the same for serial and overlapped forwards (``forward.py``)::

    poll        transfer backend; a few bootstrap/waiting senders; every running sender
    expire      deadlines that passed (bootstrap, transfer, per request)
    schedule    plan N+1: continue prefilling requests, then admit waiting ones FCFS
    collect     wait for forward N                       ┐ overlapped: all of this runs
    launch      start forward N+1                        │ while forward N (then N+1)
    consume     N's pages → sender.send_pages; last      │ computes on the executor thread
                chunk → aux row → sender.send_aux        ┘

Every request ends through ``_finish``: sender failed (if need be) and closed, then pages and
aux row freed (pages still read by a running forward are freed when it is collected), one
``Outcome`` counted, observed and handed to the sink.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from prefill_worker.batch import BatchOutput, ChunkPlan, ModelRunner, SampledToken
from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.tables import PageTable, num_pages_for
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    Request,
    RequestState,
    end_state,
)
from prefill_worker.scheduler.admission import Admission, ScheduledBatch
from prefill_worker.scheduler.deadlines import DeadlineHeap, DeadlineKind
from prefill_worker.scheduler.forward import make_forward
from prefill_worker.scheduler.inbox import EngineMessage, Inbox
from prefill_worker.scheduler.observer import (
    EngineObserver,
    LoadSnapshot,
    NullObserver,
    OutcomeSink,
)
from prefill_worker.scheduler.queues import RequestQueues
from prefill_worker.transfer.base import KVPoll, TransferBackend

log = logging.getLogger(__name__)

_SENDER_END = {
    KVPoll.FAILED: FinishReason.TRANSFER_FAILED,
    KVPoll.ABORTED: FinishReason.ABORTED_BY_DECODE,
    KVPoll.PEER_LOST: FinishReason.PEER_LOST,
}
_MAX_WAIT_S = 0.05  # a wait never exceeds this: the stop flag is checked at least that often
_ABORT_ERRORS = {
    FinishReason.ABORTED_BY_ROUTER: "aborted by the router",
    FinishReason.ROUTER_GONE: "the router's connection closed",
}


class Engine:
    """The scheduler and its loop. All methods but ``load`` and ``last_turn_at`` belong to the
    engine thread. Draining is not its policy: the ingress stops admitting (the daemon decides
    when), and ``shutdown`` fails what is left when the drain ends."""

    def __init__(
        self,
        runner: ModelRunner,
        transfer: TransferBackend,
        pages: PagePool,
        aux: AuxPool,
        sink: OutcomeSink,
        *,
        page_size: int,
        chunk_size: int,
        max_batch_tokens: int,
        max_running_requests: int,
        bootstrap_timeout_s: float,
        transfer_timeout_s: float,
        overlap: bool,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_budget: int = 32,
        max_messages_per_turn: int = 256,
    ) -> None:
        self._transfer, self._aux, self._sink = transfer, aux, sink
        self._observer: EngineObserver = observer or NullObserver()
        self._clock = clock
        self._table = PageTable(pages, page_size)
        self._queues = RequestQueues(self._observer.on_transition)
        self._admission = Admission(
            self._queues,
            self._table,
            aux,
            clock,
            chunk_size=chunk_size,
            max_batch_tokens=max_batch_tokens,
            max_running_requests=max_running_requests,
        )
        self._forward = make_forward(runner, overlap)
        self._deadlines = DeadlineHeap()
        self.page_size = page_size
        self.bootstrap_timeout_s, self.transfer_timeout_s = bootstrap_timeout_s, transfer_timeout_s
        self._poll_budget = poll_budget
        self._max_messages = max_messages_per_turn
        self._running: ScheduledBatch | None = None
        self._deferred: list[tuple[int, ...]] = []  # pages of ended requests a forward may write
        self._is_closed = False
        self.outcome_counts: Counter[FinishReason] = Counter()
        self.last_turn_at = clock()  # for /livez: read from any thread
        self._load = LoadSnapshot()
        self._publish()

    # ---- any thread -------------------------------------------------------------------

    @property
    def load(self) -> LoadSnapshot:
        return self._load

    # ---- engine thread ----------------------------------------------------------------

    def run(self, stop: threading.Event, inbox: Inbox) -> None:
        """Turn until ``stop`` is set (``inbox.wake()`` makes it look at once). When a turn
        did nothing the loop sleeps until a message, the transfer backend's next event, or
        the next deadline. On an error, every live request fails, then it raises."""
        try:
            while not stop.is_set():
                self._take(inbox)
                if not self.step():
                    self._wait(inbox)
        except Exception as exc:
            log.exception("engine loop failed")
            self.fail_all(FinishReason.ENGINE_ERROR, f"engine error: {exc!r}")
            raise

    def submit(self, message: EngineMessage) -> None:
        """Take one message. Ids are unique among live requests and prompts are not empty: the
        ingress owns both policies (it scopes router ids by connection, rejects duplicates and
        empty prompts), so the engine trusts them."""
        if isinstance(message, AbortRequest):
            req = self._queues.live.get(message.request_id)
            if req is not None:
                error = _ABORT_ERRORS.get(message.reason, message.reason.value)
                self._finish(req, message.reason, error)
            return
        assert message.request_id not in self._queues.live, f"{message.request_id!r} is live"
        assert message.token_ids, f"{message.request_id!r} has an empty prompt"
        num_tokens = len(message.token_ids)
        sender = self._transfer.create_sender(
            message.bootstrap_room,
            message.request_id,
            num_tokens,
            allowed_peer=message.decode_peer,
        )
        req = Request(message, sender)
        self._queues.add(req)
        if not self._table.can_ever_fit(num_tokens):
            need = num_pages_for(num_tokens, self.page_size)
            self._finish(
                req,
                FinishReason.PROMPT_TOO_LONG,
                f"{num_tokens} tokens need {need} KV pages; the pool has "
                f"{self._table.pool.num_pages}",
            )
        else:
            self._deadlines.push(
                req.arrival_time + self.bootstrap_timeout_s, DeadlineKind.BOOTSTRAP, req
            )
            if req.deadline_s is not None:
                self._deadlines.push(req.arrival_time + req.deadline_s, DeadlineKind.REQUEST, req)

    def step(self) -> bool:
        """One turn; True when a forward was launched or consumed (call again at once)."""
        started = time.perf_counter()
        self._transfer.poll()
        self._poll_senders()
        self._expire()
        batch = self._admission.next_batch()
        done = self._collect()
        if batch is not None:
            self._launch(batch)
        if done is not None:
            self._consume(*done)
        self._publish()
        if batch is None and done is None:
            return False
        num_tokens = batch.plan.num_tokens if batch is not None else 0
        self._observer.on_step(time.perf_counter() - started, num_tokens)
        return True

    def fail_all(self, reason: FinishReason, error: str) -> None:
        for req in list(self._queues.live.values()):
            self._finish(req, reason, error)
        self._publish()

    def shutdown(self, reason: FinishReason = FinishReason.DRAINING) -> None:
        """Wait for the running forward, fail what is left with ``reason``, stop the executor."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            self._collect()
        except Exception:
            log.exception("forward failed during shutdown")
        self.fail_all(reason, f"the worker shut down ({reason.value})")
        self._forward.close()

    def check_integrity(self) -> None:
        self._queues.check_integrity()
        self._table.check_integrity(self._deferred)
        self._aux.check_integrity()
        held = sum(1 for r in self._queues.live.values() if r.aux_row is not None)
        assert self._aux.num_rows - self._aux.num_free == held

    # ---- one turn ---------------------------------------------------------------------

    def _take(self, inbox: Inbox) -> None:
        inbox.clear_wake()  # before draining: a later put wakes the next wait
        for _ in range(self._max_messages):
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                return
            self.submit(message)

    def _wait(self, inbox: Inbox) -> None:
        """Sleep until there is work: the backend waits on its own sockets and times, and
        the inbox's fd; the engine bounds it by its next deadline. A forward in flight never
        gets here: ``step`` collects it (blocking) and reports a busy turn."""
        if not inbox.empty():
            return
        timeout_s = _MAX_WAIT_S
        next_at = self._deadlines.next_at()
        if next_at is not None:
            timeout_s = min(timeout_s, next_at - self._clock())
        if timeout_s > 0:
            self._transfer.wait(timeout_s, inbox.fileno())

    def _poll_senders(self) -> None:
        for req in self._queues.next_watched(self._poll_budget):
            self._check_sender(req)
        head = self._queues.head_waiting()
        if head is not None:
            self._check_sender(head)  # admission next: catch an abort or failure first
        for req in list(self._queues.prefilling.values()):
            self._check_sender(req)
        for req in list(self._queues.inflight.values()):
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
            return self._finish(req, FinishReason.ENGINE_ERROR, f"engine error: {exc!r}")
        if status is KVPoll.READY:
            if req.state is RequestState.BOOTSTRAPPING:
                req.num_cached_tokens = req.sender.num_cached_tokens()
                req.ready_time = self._clock()
                self._queues.move(req, RequestState.WAITING)
        elif status is KVPoll.SUCCESS:
            if req.state is RequestState.TRANSFERRING:
                self._finish(req, FinishReason.OK, None)
        elif status in _SENDER_END:
            reason = req.sender.failure_reason() or f"sender {status.value}"
            self._finish(req, _SENDER_END[status], reason)

    def _expire(self) -> None:
        for kind, req in self._deadlines.pop_expired(self._clock()):
            if kind is DeadlineKind.BOOTSTRAP and req.state is RequestState.BOOTSTRAPPING:
                # No room in the text: it is logged, and rooms are capabilities.
                error = f"no handshake from the decode peer within {self.bootstrap_timeout_s}s"
                self._finish(req, FinishReason.BOOTSTRAP_TIMEOUT, error)
            elif kind is DeadlineKind.TRANSFER and req.state is RequestState.TRANSFERRING:
                error = f"KV transfer did not finish within {self.transfer_timeout_s}s"
                self._finish(req, FinishReason.TRANSFER_TIMEOUT, error)
            elif kind is DeadlineKind.REQUEST and not req.state.is_terminal:
                error = f"request deadline of {req.deadline_s}s passed while {req.state.value}"
                self._finish(req, FinishReason.DEADLINE_EXCEEDED, error)

    def _collect(self) -> tuple[ScheduledBatch, BatchOutput] | None:
        batch, self._running = self._running, None
        if batch is None:
            return None
        try:
            output = self._forward.collect()
        finally:
            for req in batch.requests:
                req.is_in_forward = False
            for page_ids in self._deferred:
                self._table.pool.free(page_ids)
            self._deferred.clear()
        return batch, output

    def _launch(self, batch: ScheduledBatch) -> None:
        for req in batch.requests:
            req.is_in_forward = True
        self._running = batch
        self._forward.launch(batch.plan)

    def _consume(self, batch: ScheduledBatch, output: BatchOutput) -> None:
        sampled = {token.request_id: token for token in output.sampled}
        for chunk, req in zip(batch.plan.chunks, batch.requests, strict=True):
            if req.state is not RequestState.PREFILLING:
                continue  # ended while its chunk was computing
            try:
                self._consume_chunk(chunk, req, sampled.get(req.request_id))
            except AssertionError:
                raise  # a broken invariant is shared state: the engine stops
            except Exception as exc:  # this request's own data: it fails, the engine goes on
                log.exception("request %s failed in its chunk's post-processing", req.request_id)
                if not req.state.is_terminal:
                    self._finish(req, FinishReason.ENGINE_ERROR, f"engine error: {exc!r}")

    def _consume_chunk(self, chunk: ChunkPlan, req: Request, token: SampledToken | None) -> None:
        assert req.sender is not None
        req.num_computed_tokens = chunk.end
        first, end = chunk.start // self.page_size, num_pages_for(chunk.end, self.page_size)
        req.sender.send_pages(req.page_ids[first:end], first)
        if chunk.sampling is None:
            return
        assert token is not None, f"no sampled token for {req.request_id!r}"
        if token.error is not None:
            self._finish(req, FinishReason.ENGINE_ERROR, f"sampling failed: {token.error}")
        else:
            self._end_prefill(req, token)

    def _end_prefill(self, req: Request, token: SampledToken) -> None:
        assert req.sender is not None and req.aux_row is not None
        logprob = token.logprob if req.return_logprob else math.nan
        row = AuxRow(token.token_id, logprob, req.num_prompt_tokens, req.num_cached_tokens)
        self._aux.write(req.aux_row, row)
        req.sender.send_aux(req.aux_row)
        req.first_token_id = token.token_id
        req.first_token_logprob = token.logprob if req.return_logprob else None
        req.prefill_end_time = now = self._clock()
        self._queues.move(req, RequestState.TRANSFERRING)
        self._deadlines.push(now + self.transfer_timeout_s, DeadlineKind.TRANSFER, req)

    # ---- the one way out ----------------------------------------------------------------

    def _finish(self, req: Request, reason: FinishReason, error: str | None) -> None:
        assert req.sender is not None
        if reason not in (FinishReason.OK, FinishReason.ABORTED_BY_DECODE):
            req.sender.fail(error or reason.value)
        req.sender.close()  # only now may pages and the aux row be reused
        req.finish_time = self._clock()
        self._queues.move(req, end_state(reason))
        if req.aux_row is not None:
            self._aux.free(req.aux_row)
            req.aux_row = None
        if req.page_ids:
            if req.is_in_forward:
                self._deferred.append(self._table.detach(req.request_id))
            else:
                self._table.release(req.request_id)
        transfer_bytes = req.sender.written_bytes()
        self._emit(req.outcome(reason, error, req.finish_time, transfer_bytes))

    def _emit(self, outcome: Outcome) -> None:
        self.outcome_counts[outcome.reason] += 1
        self._observer.on_outcome(outcome)
        self._sink(outcome)

    def _publish(self) -> None:
        queues = self._queues
        load = LoadSnapshot(
            num_bootstrapping=queues.num_bootstrapping,
            num_waiting=queues.num_waiting,
            num_prefilling=len(queues.prefilling),
            num_transferring=len(queues.inflight),
            num_free_pages=self._table.pool.num_free,
            num_total_pages=self._table.pool.num_pages,
            num_free_aux_rows=self._aux.num_free,
            num_total_aux_rows=self._aux.num_rows,
        )
        self.last_turn_at = self._clock()
        if load != self._load:
            self._load = load
            self._observer.on_load(load)
