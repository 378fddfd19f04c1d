"""Where NIXL writes are posted and progressed: on the transfer thread, or inline.

Over UCX's cma transport ``postXferReq`` copies the bytes before it returns, so a write
posted from the engine thread would stall the loop for the whole copy (docs/architecture.md,
"Threads"). ``PushThread`` (``nixl.push_thread``) owns the NIXL agent instead::

    engine thread                           transfer thread (owns the agent)
      post(...)  ─▶ queue ─────────────────▶ make_prepped_xfer, transfer (the copy)
      release(w) ─▶ control queue ─────────▶ release (cancels), before any queued post
      run(fn)    ─▶ control queue, waits ──▶ fn(): add_remote_agent, prep lists, ...
      run_later(fn) ─▶ control queue ──────▶ fn(): remove_remote_agent, ...
      poll: reads each write's state  ◀──── state set, wake fd written

``InlinePoster`` makes the same calls on the caller's thread (unit tests, the benchmark).
A ``Write`` is settled once none of its bytes can land any more: only then may a failure be
told. With ``telemetry`` (the agent made with ``capture_telemetry``) a write that finished
DONE carries what NIXL measured of it (``read_telemetry``), read before its handle is released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from prefill_worker.transfer.nixl.agent import NIXL_ERRORS

log = logging.getLogger(__name__)


Prepare = Callable[[Any], Any]  # agent -> an unposted transfer handle
Telemetry = tuple[float, float]  # NIXL's (post, transfer) durations of one write, in seconds


class Write(Protocol):
    """One posted write of KV pages or an aux row."""

    num_bytes: int
    num_descs: int  # its descriptors (0: not a write of this agent's, say another rank's)
    telemetry: Telemetry | None  # once DONE, when the poster captures it
    prep_s: float  # building its transfer request (make_prepped_xfer), wherever that ran
    prep_cpu_s: float  # the same in CPU time of the thread that ran it (no preemption)

    def state(self) -> str:
        """``PROC`` (queued or in flight), ``DONE``, or ``ERR (...)``; never blocks."""
        ...

    def release(self) -> None:
        """Release it, cancelling it if in flight; idempotent, never blocks."""
        ...

    @property
    def is_settled(self) -> bool:
        """No byte of it can land any more: finished, or released."""
        ...

    @property
    def is_refused(self) -> bool:
        """NIXL refused to release it (the last attempt); call ``release`` again."""
        ...


class WritePoster(Protocol):
    """Posts writes and runs the agent's other calls where the agent lives."""

    @property
    def wake_fd(self) -> int | None:
        """Readable when a write changed state; None: poll (``needs_polling``)."""
        ...

    @property
    def needs_polling(self) -> bool:
        """True when write states change only when looked at (no thread of its own)."""
        ...

    def post(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, num_bytes: int
    ) -> Write:
        """A WRITE between two prepared lists (``make_prepped_xfer``)."""
        ...

    def post_with(self, prepare: Prepare, num_bytes: int, num_descs: int) -> Write:
        """A WRITE of ``num_descs`` descriptors whose handle ``prepare(agent)`` makes where the
        agent lives (one made of descriptors built per write, say); NIXL errors it raises fail
        the write."""
        ...

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` where the agent lives; waits for it, raises what it raised."""
        ...

    def run_later(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` where the agent lives, after every release and call queued so far."""
        ...

    def clear_wake(self) -> None: ...

    def close(self) -> None: ...


def prepped(local: Any, lidx: Any, remote: Any, ridx: Any, notif: bytes) -> Prepare:
    """What ``post`` prepares: a WRITE between two prepared descriptor lists."""
    return lambda agent: agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx, notif)


def read_telemetry(agent: Any, handle: Any) -> Telemetry | None:
    """NIXL's telemetry of a finished write (microseconds, as seconds); None when NIXL has
    none for it."""
    try:
        measured = agent.get_xfer_telemetry(handle)
    except NIXL_ERRORS as exc:
        log.debug("no NIXL telemetry for a write: %s", exc)
        return None
    return measured.postDuration / 1e6, measured.xferDuration / 1e6


def release_handle(handle: Any) -> bool:
    """Release a write handle; False (logged) when NIXL refuses."""
    try:
        handle.release()
    except NIXL_ERRORS as exc:
        log.warning("releasing a NIXL write handle: %s", exc)
        return False
    return True


# -- inline ---------------------------------------------------------------------------------


class _InlineWrite:
    def __init__(self, agent: Any, num_bytes: int, num_descs: int, telemetry: bool) -> None:
        self._agent, self.num_bytes, self.prep_s, self.prep_cpu_s = agent, num_bytes, 0.0, 0.0
        self.num_descs, self._wants_telemetry = num_descs, telemetry
        self.telemetry: Telemetry | None = None
        self.handle: Any = None
        self._error: str | None = None
        self._is_released = False
        self.is_refused = False

    def fail(self, error: str) -> None:
        self._error = error

    def state(self) -> str:
        if self._error is not None:
            return self._error
        try:
            state = str(self._agent.check_xfer_state(self.handle))
        except NIXL_ERRORS as exc:
            return f"ERR ({exc})"
        if state == "DONE" and self._wants_telemetry and self.telemetry is None:
            self.telemetry = read_telemetry(self._agent, self.handle)
        return state

    def release(self) -> None:
        if self.handle is None or self._is_released:
            return
        self._is_released = release_handle(self.handle)
        self.is_refused = not self._is_released

    @property
    def is_settled(self) -> bool:
        return self.handle is None or self._is_released


class InlinePoster:
    """Posts on the caller's thread: ``transfer()`` copies before it returns over cma."""

    wake_fd = None
    needs_polling = True

    def __init__(self, agent: Any, telemetry: bool = False) -> None:
        self._agent, self._telemetry = agent, telemetry

    def post(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, num_bytes: int
    ) -> Write:
        prepare = prepped(local, local_idx, remote, remote_idx, notif)
        return self.post_with(prepare, num_bytes, len(local_idx))

    def post_with(self, prepare: Prepare, num_bytes: int, num_descs: int) -> Write:
        write = _InlineWrite(self._agent, num_bytes, num_descs, self._telemetry)
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            write.handle = prepare(self._agent)
        except NIXL_ERRORS as exc:
            write.fail(f"ERR (NIXL could not prepare the write: {exc})")
            return write
        finally:
            write.prep_s = time.perf_counter() - start
            write.prep_cpu_s = time.thread_time() - start_cpu
        try:
            state = self._agent.transfer(write.handle)
        except NIXL_ERRORS as exc:
            state = f"ERR ({exc})"
        if state.startswith("ERR"):
            write.fail(f"ERR (the write failed to start: {state})")
        return write

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def run_later(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def clear_wake(self) -> None:
        return None

    def close(self) -> None:
        return None
