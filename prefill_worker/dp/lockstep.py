"""Attention-DP ranks in lockstep, for expert parallelism across them (docs/parallelism.md,
"Expert parallelism across attention-DP ranks").

With ``parallel.ep_size`` = ``dp_size`` every sparse layer's exchange is a collective over all
the DP ranks, but each rank's engine plans its own batches. So every forward goes through
this rank's ``Lockstep`` (its ``ModelRunner``), and the ranks step together, each step
decided by a vote that rank 0 calls::

    rank 0's step thread                       every other rank's step thread
    wait: its own plan, a bell, or the         (waits in the call, bounded by
      heartbeat interval                         parallel.step_timeout_s)
    call: all_reduce([stop, wanted])      <->  call: all_reduce([0, 0])
    stop: every step thread ends
    vote: all_reduce([has a plan])        <->  vote: all_reduce([has a plan])
    any plan: every rank runs a forward        its plan's, or an idle one (no tokens:
      (its plan's, or an idle one)               ``Runner.run_idle``, the exchanges only)
                                               after a step, a plan still waiting rings
                                                 the bell again

Rank 0 drives: the others wait in the vote, so a step starts as soon as rank 0 calls it,
and rank 0 calls one when its own engine hands it a plan, when a rank rings its bell (a
Unix datagram socket in the worker's private link directory: the rank has a plan), and
otherwise every ``heartbeat_interval_s``, so a waiting rank never times out and a rank that
died or stopped is found within ``step_timeout_s``: the vote (or an exchange) raises, the
lockstep fails, every forward waiting on it fails, and the worker fails as one (rank 0's
``DpRanks.problem``, a rank's own supervisor). A forward that raises mid-way (the others
may wait in its exchange) fails the lockstep likewise. A plan with no chunks needs no step.

Why two rounds: a rank waiting in a single vote would have said "no plan" when it entered
it, before its engine's next plan came, and the ranks' batches would alternate instead of
running together; the first round is the moment every rank looks. For the same reason a rank
whose own plan ran in the last step gives its engine up to ``GATHER_S`` to hand over the next
one before it votes in a step rank 0 was asked for (the engine plans it during the forward,
but the hand-over takes a few thread hops; a heartbeat waits for nothing and leaves that
memory alone). Why a vote and not the plans themselves: a rank's batch is its own (its
attention and KV are local); all the others need to know is whether to run the exchanges,
which an all-reduce of one integer says. SGLang's DP attention gathers each rank's token
count at every turn of each scheduler's (polling) loop, once its next batch is planned, for
the same reason (idle batches on ranks without work); here ranks with nothing wait instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from prefill_worker.batch import BatchOutput, BatchPlan

log = logging.getLogger(__name__)

BELL_NAME = "step-bell"
# How long a rank whose own plan ran in the last step waits for its engine's next plan
# before it votes (once: after a step without a plan of its own it votes at once).
GATHER_S = 0.005


class LockstepFailed(RuntimeError):
    """The ranks can no longer step together (a rank died, stopped or failed a forward)."""


class StepRunner(Protocol):
    def run(self, plan: BatchPlan) -> BatchOutput: ...

    def run_idle(self) -> int: ...


def bell_path(link_dir: str) -> str:
    return os.path.join(link_dir, BELL_NAME)


class Bell:
    """Rank 0's doorbell (``listen``) or a rank's handle on it: one datagram says "a rank
    has a plan"; rank 0 drains them all before each vote."""

    def __init__(self, path: str, listen: bool) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        if listen:
            self._sock.bind(path)

    def fileno(self) -> int:
        return self._sock.fileno()

    def ring(self) -> None:
        # full (rank 0 has rings to read already) or gone (the worker is failing): no matter
        with contextlib.suppress(BlockingIOError, FileNotFoundError, ConnectionRefusedError):
            self._sock.sendto(b"s", self.path)

    def drain(self) -> int:
        """Read every ring so far; how many there were."""
        count = 0
        with contextlib.suppress(BlockingIOError):
            while self._sock.recv(64):
                count += 1
        return count

    def close(self) -> None:
        self._sock.close()


@dataclass(eq=False)
class _Job:
    plan: BatchPlan
    done: threading.Event = field(default_factory=threading.Event)
    output: BatchOutput | None = None
    error: BaseException | None = None


@dataclass
class StepCounts:
    """What this rank's step thread ran: forwards of its own plans, idle forwards (another
    rank's plan), and votes (every step, heartbeats included)."""

    busy: int = 0
    idle: int = 0
    votes: int = 0


class Lockstep:
    """This DP rank's ``ModelRunner``: each plan runs on the step thread, in a step every
    rank takes (module doc). ``run`` from any one thread at a time (the engine's forward)."""

    def __init__(
        self,
        runner: StepRunner,
        rank: int,
        group: Any,
        bell: Bell,
        interval_s: float,
        on_failure: Any = None,
        gather_s: float = GATHER_S,
    ) -> None:
        self._runner, self.rank, self._group, self._bell = runner, rank, group, bell
        self._interval_s, self._on_failure = interval_s, on_failure
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # a plan was handed over
        self._gather_s = gather_s
        self._was_busy = False  # the last step ran this rank's own plan
        self._job: _Job | None = None
        self._stopping = False
        self._abandoned = False  # stopped without a last vote (a rank is gone)
        self.failure: str | None = None
        self.counts = StepCounts()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._loop, name="dp-lockstep", daemon=True)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def start(self) -> None:
        self._thread.start()

    # ---- the engine's side ------------------------------------------------------------

    def run(self, plan: BatchPlan) -> BatchOutput:
        """Blocking: the plan's forward, in the next step every rank takes."""
        if not plan.chunks:
            return self._runner.run(plan)  # no tokens, no exchange: no step
        job = _Job(plan)
        with self._lock:
            if self.failure is not None or self._stopping:
                raise LockstepFailed(self.failure or "the attention-DP lockstep stopped")
            assert self._job is None, "one plan at a time"
            self._job = job
            self._ready.notify_all()
        self._ring()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.output is not None
        return job.output

    def stop(self, timeout_s: float, vote: bool = True) -> None:
        """Rank 0: a last step that ends every rank's step thread (``vote`` False, a rank
        known dead: none, the thread ends at its next step). Another rank: wait (bounded) for
        that step. Then the plan still waiting fails."""
        with self._lock:
            self._stopping = True
            self._abandoned = not vote
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._fail_job(LockstepFailed("the attention-DP lockstep stopped"))
        self._bell.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- the step thread --------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._step():
                pass
        except Exception as exc:  # a rank gone or stopped (the vote or an exchange raised)
            self._fail(f"attention-DP lockstep failed on rank {self.rank}: {exc!r}")
        counts = self.counts
        log.info("dp rank %d lockstep ended: %d forwards, %d idle forwards, %d votes",
                 self.rank, counts.busy, counts.idle, counts.votes)  # fmt: skip

    def _step(self) -> bool:
        """One vote, and the step it decides; False once the ranks stop. The vote has two
        rounds: rank 0 calls it (the others wait in the first, which carries the stop), then
        every rank says whether it has a plan *now*: a rank whose engine hands over its next
        plan as rank 0's does (right after the last step) is in the same step, not the next."""
        rang = 0
        if self.is_leader:
            self._wait_for_reason()
            rang = self._bell.drain()
        with self._lock:
            stop = self._stopping and self.is_leader
            want = self.is_leader and (rang > 0 or self._job is not None)  # else a heartbeat
            if self._abandoned:
                return False
        call = torch.tensor([stop, want], dtype=torch.int64)
        dist.all_reduce(call, group=self._group)
        if call[0]:
            return False
        job = self._next_job(bool(call[1]))
        votes = torch.tensor([job is not None], dtype=torch.int64)
        dist.all_reduce(votes, group=self._group)
        self.counts.votes += 1
        if call[1] or votes[0]:  # a heartbeat with no plan anywhere is not a step
            self._was_busy = job is not None
        if votes[0]:
            self._forward(job)
        if not self.is_leader and self._job is not None:
            self._bell.ring()  # arrived during this step: rank 0 calls another
        return True

    def _next_job(self, wanted: bool) -> _Job | None:
        """The plan this rank votes with; in a step some rank wants (not a heartbeat), right
        after a step that ran its own plan, up to ``gather_s`` for its engine's next one
        (handed over a few thread hops after the last step: without the wait a busy rank's
        next batch would miss the step)."""
        with self._ready:
            if self._job is None and self._was_busy and wanted:
                self._ready.wait_for(lambda: self._job is not None, self._gather_s)
            return self._job

    def _wait_for_reason(self) -> None:
        """Rank 0: until its own plan, a bell, the stop, or the heartbeat interval."""
        with self._lock:
            if self._job is not None or self._stopping:
                return
        fds = [self._bell.fileno(), self._wake_r]
        ready, _, _ = select.select(fds, [], [], self._interval_s)
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def _forward(self, job: _Job | None) -> None:
        if job is None:
            self._runner.run_idle()
            self.counts.idle += 1
            return
        try:
            job.output = self._runner.run(job.plan)
        except BaseException as exc:
            job.error = exc
            raise  # the other ranks may wait in this forward's exchanges: the lockstep fails
        finally:
            with self._lock:
                self._job = None
            job.done.set()
        self.counts.busy += 1

    def _ring(self) -> None:
        if self.is_leader:
            self._wake()
        else:
            self._bell.ring()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"w")

    def _fail(self, reason: str) -> None:
        log.error("%s", reason)
        with self._lock:
            self.failure = reason
        self._fail_job(LockstepFailed(reason))
        if self._on_failure is not None:
            self._on_failure()

    def _fail_job(self, error: LockstepFailed) -> None:
        with self._lock:
            job, self._job = self._job, None
        if job is not None and not job.done.is_set():
            job.error = error
            job.done.set()
