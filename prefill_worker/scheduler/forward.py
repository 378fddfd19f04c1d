"""Where a forward batch runs, chosen once at start-up: inline, or on an executor thread.

The engine loop is the same for both. Each turn it prepares plan N+1, ``collect()``s N,
``launch()``es N+1 and then consumes N's output. ``SerialForward`` runs the plan inside
``collect()``, so nothing overlaps; ``ThreadedForward`` runs it on one worker thread from
``launch()`` on, so the loop's CPU work (messages, polling, admission, planning N+1, sending
N's pages) overlaps forward N, and while it waits for N the engine keeps the transfer
backend turning (``done_fd`` is readable once N is done). On CUDA the runner itself issues
work on its stream; the same thread strategy applies.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner


class ForwardStrategy(Protocol):
    def launch(self, plan: BatchPlan) -> None:
        """Start ``plan``; at most one plan is launched and not yet collected."""
        ...

    def collect(self) -> BatchOutput:
        """Block until the launched plan is done; its K/V is then in its pages."""
        ...

    @property
    def done_fd(self) -> int | None:
        """Readable once the launched plan is done; None: it runs inside ``collect``."""
        ...

    def is_done(self) -> bool:
        """``collect`` would not block (nothing launched, or the plan finished)."""
        ...

    def close(self) -> None: ...


class SerialForward:
    """Runs each plan on the engine thread, when it is collected."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._plan: BatchPlan | None = None

    def launch(self, plan: BatchPlan) -> None:
        assert self._plan is None, "previous plan not collected"
        self._plan = plan

    def collect(self) -> BatchOutput:
        plan, self._plan = self._plan, None
        assert plan is not None, "nothing launched"
        return self._runner.run(plan)

    done_fd = None

    def is_done(self) -> bool:
        return True  # nothing runs until collect

    def close(self) -> None:
        self._plan = None


class ThreadedForward:
    """Runs each plan on one executor thread while the engine loop goes on."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._future: Future[BatchOutput] | None = None
        self._done_r, self._done_w = os.pipe()  # a byte per finished plan
        os.set_blocking(self._done_r, False)
        os.set_blocking(self._done_w, False)

    def launch(self, plan: BatchPlan) -> None:
        """Returns once the forward thread has picked the plan up.

        Waiting for that hand-over lets the forward reach its first GIL-free section
        (a kernel, a device wait) before this thread goes back to holding the GIL;
        otherwise it could sit up to the interpreter's switch interval (5 ms) unscheduled.
        """
        assert self._future is None, "previous plan not collected"
        started = threading.Event()
        self._future = self._executor.submit(self._run, plan, started)
        started.wait()

    def _run(self, plan: BatchPlan, started: threading.Event) -> BatchOutput:
        started.set()
        try:
            return self._runner.run(plan)
        finally:
            with contextlib.suppress(BlockingIOError):
                os.write(self._done_w, b"d")

    def collect(self) -> BatchOutput:
        future, self._future = self._future, None
        assert future is not None, "nothing launched"
        try:
            return future.result()
        finally:
            with contextlib.suppress(BlockingIOError):
                os.read(self._done_r, 4096)

    @property
    def done_fd(self) -> int:
        return self._done_r

    def is_done(self) -> bool:
        return self._future is None or self._future.done()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        os.close(self._done_r)
        os.close(self._done_w)


def make_forward(runner: ModelRunner, overlap: bool) -> ForwardStrategy:
    return ThreadedForward(runner) if overlap else SerialForward(runner)
