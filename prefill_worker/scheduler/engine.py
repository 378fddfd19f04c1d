"""The engine loop: takes requests, admits and chunks them, runs forwards, pushes KV, replies.

One turn (``step``), the same for serial and overlapped forwards (``forward.py``)::

    poll        transfer backend; a few bootstrap/waiting senders; every running sender
    expire      deadlines that passed (bootstrap, transfer, per request)
    schedule    plan N+1: continue prefilling requests, then admit waiting ones FCFS
    collect     wait for forward N                       ┐ overlapped: all of this runs
    launch      start forward N+1; the cached pages of   │ while forward N (then N+1)
                its new requests → sender.send_pages     │ computes on the executor thread
    consume     N's pages → prefix cache and             │
                sender.send_pages; last chunk → aux row  │
                → sender.send_aux                        ┘

What happens to each request is ``lifecycle.RequestLifecycle``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from prefill_worker.batch import BatchOutput, ModelRunner
from prefill_worker.inbox import EngineMessage, Inbox
from prefill_worker.kv.tables import PageTable
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import FinishReason, Outcome
from prefill_worker.scheduler.admission import Admission, ScheduledBatch
from prefill_worker.scheduler.costs import CostEstimator
from prefill_worker.scheduler.forward import make_forward
from prefill_worker.scheduler.lifecycle import RequestLifecycle
from prefill_worker.scheduler.liveness import ForwardClock, Progress
from prefill_worker.scheduler.observer import EngineObserver, NullObserver, OutcomeSink
from prefill_worker.scheduler.options import EngineKV, EngineLimits
from prefill_worker.transfer.base import TransferBackend

log = logging.getLogger(__name__)

_MAX_WAIT_S = 0.05  # a wait never exceeds this: the stop flag is checked at least that often


class Engine:
    """The scheduler and its loop. All methods but ``load``, ``last_turn_at`` and ``progress``
    belong to the engine thread. Draining is not its policy: the ingress stops admitting (the
    daemon decides when), and ``shutdown`` fails what is left when the drain ends."""

    def __init__(
        self,
        runner: ModelRunner,
        transfer: TransferBackend,
        kv: EngineKV,
        sink: OutcomeSink,
        limits: EngineLimits,
        *,
        overlap: bool,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transfer, self._aux = transfer, kv.aux
        self._observer: EngineObserver = observer or NullObserver()
        self._clock = clock
        self.limits = limits
        # no prefix cache: the table uses NoPrefixCache
        self._table = PageTable(
            kv.pages, limits.page_size, kv.prefix_cache, kv.sliding, pins=kv.pins
        )
        self._costs = CostEstimator(clock, limits.chunk_size, limits.max_batch_tokens)
        self._sink = sink
        self._life = RequestLifecycle(
            transfer, self._table, kv.aux, self._on_outcome, self._observer, clock, limits
        )
        self._queues = self._life.queues
        self._admission = Admission(
            self._queues,
            self._table,
            kv.aux,
            clock,
            chunk_size=limits.chunk_size,
            max_batch_tokens=limits.max_batch_tokens,
            max_running_requests=limits.max_running_requests,
            on_lookup=self._observer.on_prefix_lookup,
            make_room=self._life.handoff.make_room,
            on_admit=self._life.handoff.on_admit,
            optimistic_share=limits.optimistic_share,
        )
        self._forward_clock = ForwardClock(runner, clock)
        self._forward = make_forward(self._forward_clock, overlap)
        self._running: ScheduledBatch | None = None
        self._is_closed = False
        self.last_turn_at = clock()  # for /livez: read from any thread
        self._load = LoadSnapshot()
        self._publish()

    # ---- any thread -------------------------------------------------------------------

    @property
    def load(self) -> LoadSnapshot:
        return self._load

    def progress(self) -> Progress:
        """The last turn and the forward in progress, for ``/livez`` (``scheduler.liveness``)."""
        return self._forward_clock.progress(self.last_turn_at)

    @property
    def outcome_counts(self) -> Counter[FinishReason]:
        """Outcomes so far, by reason (engine thread)."""
        return self._life.outcome_counts

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
        """Take one message (``RequestLifecycle.submit``): a prefill, or an abort."""
        self._life.submit(message)

    def step(self) -> bool:
        """One turn; True when a forward was launched or consumed (call again at once)."""
        started = time.perf_counter()
        self._transfer.poll()
        self._life.poll_senders()
        self._life.expire()
        batch = self._admission.next_batch()
        if self._running is not None:
            self._publish()  # before collect waits out the forward in flight (below)
        done = self._collect()
        if batch is not None:
            self._launch(batch)
            self._life.send_prefix_hits(batch)
        if done is not None:
            self._life.consume(*done)
        self._publish()
        if batch is None and done is None:
            return False
        num_tokens = batch.plan.num_tokens if batch is not None else 0
        self._observer.on_step(time.perf_counter() - started, num_tokens)
        return True

    def fail_all(self, reason: FinishReason, error: str) -> None:
        self._life.fail_all(reason, error)
        self._publish()

    def shutdown(
        self, reason: FinishReason = FinishReason.DRAINING, inbox: Inbox | None = None
    ) -> None:
        """Wait for the running forward, fail what is left with ``reason``, stop the executor.
        What ``inbox`` still holds (put after the loop's last turn: the loop stopped, or raised,
        with messages queued) is taken first, so every request in it gets its one reply too."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            self._collect()
        except Exception:
            log.exception("forward failed during shutdown")
        error = f"the worker shut down ({reason.value})"
        num_untaken = 0
        while inbox is not None and not inbox.empty():
            self._life.fail_untaken(inbox.get_nowait(), reason, error)
            num_untaken += 1
        if num_untaken:
            log.warning("shutdown: %d messages the loop never took answered", num_untaken)
        self.fail_all(reason, error)
        self._forward.close()
        try:
            self.reset_prefix_cache()  # nothing is in use any more: every cached page goes
        except Exception:  # after an engine error the cache may be what broke
            log.exception("prefix cache reset failed during shutdown")

    def reset_prefix_cache(self) -> bool:
        """Evict every cached page no request uses; True when the cache is then empty."""
        is_empty = self._table.cache.reset()
        self._publish()
        return is_empty

    def check_integrity(self) -> None:
        self._life.check_integrity()

    # ---- one turn ---------------------------------------------------------------------

    def _take(self, inbox: Inbox) -> None:
        inbox.clear_wake()  # before draining: a later put wakes the next wait
        for _ in range(self.limits.max_messages_per_turn):
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
        next_at = self._life.deadlines.next_at()
        if next_at is not None:
            timeout_s = min(timeout_s, next_at - self._clock())
        if timeout_s > 0:
            self._transfer.wait(timeout_s, inbox.fileno())

    def _collect(self) -> tuple[ScheduledBatch, BatchOutput] | None:
        if self._running is None:
            return None
        self._turn_transfers_until_done()
        batch, self._running = self._running, None
        try:
            output = self._forward.collect()
        finally:
            for req in batch.requests:
                req.is_in_forward = False
            self._life.release_deferred()
        self._observer.on_forward(batch.plan, *self._forward_clock.last_forward)
        return batch, output

    def _turn_transfers_until_done(self) -> None:
        """While the forward runs, the transfer backend keeps turning: heartbeats, handshakes,
        writes that landed, aux rows and statuses go on (a long forward must not make this
        worker look silent to its decode peers, nor hold back a finished push), and requests
        whose push ended are answered. Nothing else moves: requests in a batch, their pages
        and the batch planned next wait for the forward (senders never call back)."""
        done_fd = self._forward.done_fd
        if done_fd is None or self._is_closed:  # shutting down: just collect
            return
        while not self._forward.is_done():
            self._transfer.wait(_MAX_WAIT_S, done_fd)
            self._transfer.poll()
            self._life.poll_transferring()

    def _launch(self, batch: ScheduledBatch) -> None:
        for req in batch.requests:
            req.is_in_forward = True
        self._running = batch
        self._forward.launch(batch.plan)

    def _on_outcome(self, outcome: Outcome) -> None:
        self._costs.on_outcome(outcome)
        self._sink(outcome)

    def _publish(self) -> None:
        queues = self._queues
        costs = self._costs.signals(
            queues.num_queued_tokens,
            queues.prefilling.values(),
            self._forward_clock.cost,
            queues.num_arrived_tokens,
        )
        sliding = self._table.sliding
        load = LoadSnapshot(
            num_bootstrapping=queues.num_bootstrapping,
            num_waiting=queues.num_waiting,
            num_prefilling=len(queues.prefilling),
            num_transferring=len(queues.inflight),
            num_free_pages=self._table.num_available_pages,
            num_total_pages=self._table.pool.num_pages,
            num_cached_pages=self._table.cache.num_pages,
            num_used_sliding_pages=0 if sliding is None else sliding.num_held_pages,
            num_free_aux_rows=self._aux.num_free,
            num_total_aux_rows=self._aux.num_rows,
            costs=costs,
        )
        self.last_turn_at = self._clock()
        if load != self._load:
            self._load = load
            self._observer.on_load(load)
