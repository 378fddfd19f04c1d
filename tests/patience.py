"""How patient the tests are: the one factor by which every wait that assumes an idle machine
grows on a busy one.

A test that waits for another process (a child to start, a counter to move, a worker to exit
after SIGTERM) waits up to ``patient(seconds)``: the figure written in the test, for an idle
machine, times ``SCALE``. ``SCALE`` is read once, here, from ``PW_TEST_TIMEOUT_SCALE`` (default
3: the suite passes on the 2-core machine with two busy-loop processes beside it; raise it on a
busier one). Waits end as soon as what they wait for is true, so a larger factor costs nothing
when the suite passes; only a failure takes longer to report. What a test asserts does not
change, and a deadline the worker itself promises is a setting of the worker, never scaled.

Where it applies: ``tests.polling.wait_until``; the harnesses' waits for replies, rooms and
exits (``tests/reliability/harness.py``, ``tests/integration/daemon/conftest.py``,
``tests/reliability/watch.py``); the child processes' start and stop
(``prefill_worker.testing.launch.ChildProcess``, through its ``PATIENCE``, set by
``tests/conftest.py``; the decode child's calls and the OTLP receiver's waits use the same
``PATIENCE``); pytest-timeout's per-test limit; and each test's own bounded waits on another
process or thread (HTTP and socket timeouts, ZMQ polls, ``Future.result``, ``Thread.join``,
``Event.wait``), written ``patient(5)``, never a bare number.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("PW_TEST_TIMEOUT_SCALE", "3"))
if not SCALE >= 1:
    raise ValueError(f"PW_TEST_TIMEOUT_SCALE must be at least 1, not {SCALE}")


def patient(seconds: float) -> float:
    """How long to wait for what takes ``seconds`` on an idle machine."""
    return seconds * SCALE
