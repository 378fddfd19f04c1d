"""The transfer thread: it owns the NIXL agent and posts, progresses and releases every write,
so a copy never runs on the engine thread (``nixl.poster`` says why and draws the queues).

A write is a ``_Ticket``. Its phase moves only forward::

    QUEUED ─▶ POSTING ─▶ POSTED ─▶ FINISHED        DONE or ERR, handle released
       │          └─────────┴────▶ RELEASED        released on request (cancelled)
       └─────────────────────────▶ RELEASED        released before it was posted: nothing sent

QUEUED → RELEASED happens on the caller's thread under the lock; every other move on the
transfer thread, which then writes the wake fd. Control work (releases, ``run``,
``run_later``) goes before queued posts, in the order it was asked for, so a peer's writes
are released before its agent is removed. ``close`` releases what is left, then stops.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.nixl.poster import (
    Prepare,
    Telemetry,
    prepped,
    read_telemetry,
    release_handle,
)

log = logging.getLogger(__name__)

_PROGRESS_S = 0.001  # writes in flight are checked this often (NIXL gives no fd)
# While idle the agent is progressed this often anyway: UCX lets go of a TCP connection a
# peer closed (its fd) only as its worker progresses (before: each one a raw client opened
# and closed on the listener stayed an open fd for the process's life).
_IDLE_PROGRESS_S = 1.0


class _Phase(enum.Enum):
    QUEUED = 1
    POSTING = 2
    POSTED = 3
    FINISHED = 4
    RELEASED = 5


_SETTLED = (_Phase.FINISHED, _Phase.RELEASED)


class _Ticket:
    """A ``poster.Write`` whose NIXL calls all run on the transfer thread."""

    def __init__(self, owner: PushThread, prepare: Prepare, num_bytes: int, num_descs: int) -> None:
        self._owner = owner
        self.prepare = prepare  # agent -> handle, called on the transfer thread
        self.num_bytes, self.num_descs = num_bytes, num_descs
        self.telemetry: Telemetry | None = None  # set before status says DONE
        self.prep_s = self.prep_cpu_s = 0.0
        self.handle: Any = None
        self.status = "PROC"  # what state() says: PROC, DONE, ERR (...)
        self.phase = _Phase.QUEUED
        self.is_refused = False
        self.is_release_asked = False

    def state(self) -> str:
        return self.status

    def release(self) -> None:
        self._owner.release(self)

    @property
    def is_settled(self) -> bool:
        return self.phase in _SETTLED


Control = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any] | None"]


class PushThread:
    """Owns the agent from construction to ``close``; implements ``poster.WritePoster``."""

    needs_polling = False

    def __init__(
        self,
        agent: Any,
        name: str = "nixl-push",
        on_change: Callable[[], None] | None = None,
        telemetry: bool = False,  # the agent captures it: read each DONE write's
    ) -> None:
        self._agent, self._telemetry = agent, telemetry
        self._on_change = on_change  # also told when a write changes state (any thread's wake)
        self._cv = threading.Condition()
        self._posts: collections.deque[_Ticket] = collections.deque()
        self._control: collections.deque[Control] = collections.deque()
        self._inflight: list[_Ticket] = []  # transfer thread only
        self._is_stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # -- any thread but the transfer thread ----------------------------------------------

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def post(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, num_bytes: int
    ) -> _Ticket:
        prepare = prepped(local, local_idx, remote, remote_idx, notif)
        return self.post_with(prepare, num_bytes, len(local_idx))

    def post_with(self, prepare: Prepare, num_bytes: int, num_descs: int) -> _Ticket:
        ticket = _Ticket(self, prepare, num_bytes, num_descs)
        with self._cv:
            if self._is_stopping:
                ticket.status = "ERR (the transfer thread has stopped)"
                ticket.phase = _Phase.RELEASED
                return ticket
            self._posts.append(ticket)
            self._cv.notify()
        return ticket

    def release(self, ticket: _Ticket) -> None:
        with self._cv:
            if ticket.is_settled or (ticket.is_release_asked and not ticket.is_refused):
                return
            if ticket.phase is _Phase.QUEUED:  # never posted: nothing to cancel
                self._posts.remove(ticket)
                ticket.phase = _Phase.RELEASED
                return
            ticket.is_release_asked, ticket.is_refused = True, False
            self._control.append((self._release, (ticket,), None))
            self._cv.notify()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        future: Future[Any] = Future()
        with self._cv:
            is_stopped = self._is_stopping
            if not is_stopped:
                self._control.append((fn, args, future))
                self._cv.notify()
        if is_stopped:  # after close: the agent is the caller's again
            return fn(*args)
        return future.result()

    def run_later(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._cv:
            is_stopped = self._is_stopping
            if not is_stopped:
                self._control.append((fn, args, None))
                self._cv.notify()
        if is_stopped:
            fn(*args)

    def clear_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def close(self) -> None:
        """Run what was asked, release queued and in-flight writes, stop; then the agent is
        the caller's again."""
        with self._cv:
            self._is_stopping = True
            self._cv.notify()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the transfer thread -------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._serve()
        except Exception:  # the daemon's thread watch sees the thread stop: not live
            log.exception("the NIXL transfer thread %s stopped", threading.current_thread().name)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._is_stopping or self._control or self._posts or self._inflight):
                    if not self._cv.wait(_IDLE_PROGRESS_S):
                        self._progress_idle()
                controls = list(self._control)
                self._control.clear()
                ticket = None
                if self._posts and not controls and not self._is_stopping:
                    ticket = self._posts.popleft()
                    ticket.phase = _Phase.POSTING
                is_last = self._is_stopping and not controls
            for control in controls:
                self._run_one(control)
            if ticket is not None:
                self._post(ticket)
            is_changed = self._check_inflight() or bool(controls) or ticket is not None
            if is_changed:
                self._wake()
            if is_last:
                return self._stop()
            with self._cv:
                if self._inflight and not (self._control or self._posts or self._is_stopping):
                    self._cv.wait(_PROGRESS_S)

    def _progress_idle(self) -> None:
        """Progress the agent with nothing in flight (``_IDLE_PROGRESS_S`` says why). The
        worker's push agents receive no notifications, so reading them loses nothing."""
        try:
            self._agent.get_new_notifs()
        except AssertionError:
            raise
        except Exception:  # best effort: a broken agent shows in the next write it posts
            log.debug("idle progress of the NIXL agent failed", exc_info=True)

    def _run_one(self, control: Control) -> None:
        fn, args, future = control
        try:
            result = fn(*args)
        except Exception as exc:  # the caller's problem (run) or logged (run_later)
            if future is None:
                log.warning("transfer thread: queued call %r failed: %r", fn, exc)
            else:
                future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)

    def _post(self, ticket: _Ticket) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            ticket.handle = ticket.prepare(self._agent)
        except NIXL_ERRORS as exc:
            ticket.status = f"ERR (NIXL could not prepare the write: {exc})"
            ticket.phase = _Phase.FINISHED
            return
        finally:
            ticket.prep_s = time.perf_counter() - start
            ticket.prep_cpu_s = time.thread_time() - start_cpu
        try:
            state = self._agent.transfer(ticket.handle)  # over cma: the copy, here
        except NIXL_ERRORS as exc:
            state = f"ERR ({exc})"
        if state.startswith("ERR"):
            self._finish(ticket, f"ERR (the write failed to start: {state})")
        elif state == "DONE":
            self._finish(ticket, "DONE")
        else:
            ticket.phase = _Phase.POSTED
            self._inflight.append(ticket)

    def _check_inflight(self) -> bool:
        is_changed = False
        for ticket in list(self._inflight):
            try:
                state = str(self._agent.check_xfer_state(ticket.handle))
            except NIXL_ERRORS as exc:
                state = f"ERR ({exc})"
            if state != "PROC":
                self._inflight.remove(ticket)
                self._finish(ticket, state)
                is_changed = True
        return is_changed

    def _finish(self, ticket: _Ticket, status: str) -> None:
        """DONE or ERR: its handle is released here (a refusal is retried on ``release``)."""
        if status == "DONE" and self._telemetry:
            ticket.telemetry = read_telemetry(self._agent, ticket.handle)
        ticket.status = status
        if ticket.handle is None or release_handle(ticket.handle):
            ticket.phase = _Phase.FINISHED
        else:
            ticket.is_refused = True

    def _release(self, ticket: _Ticket) -> None:
        if ticket.is_settled:
            return
        if ticket in self._inflight:
            self._inflight.remove(ticket)
        if release_handle(ticket.handle):
            ticket.phase = _Phase.RELEASED
        else:
            ticket.is_refused = True

    def _stop(self) -> None:
        with self._cv:
            queued = list(self._posts)
            self._posts.clear()
        for ticket in queued:
            ticket.status, ticket.phase = "ERR (the transfer thread stopped)", _Phase.RELEASED
        for ticket in list(self._inflight):
            self._release(ticket)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"w")
        if self._on_change is not None:
            self._on_change()
