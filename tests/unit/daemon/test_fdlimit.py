"""``raise_fd_limit``: the soft open-file limit goes up to the hard one (in a child process,
so this test's own limit is left alone); ``start_listener_guard``: off at 0, its count on
/metrics."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry

from prefill_worker.service.fdlimit import start_listener_guard

CHILD = """
import resource
from prefill_worker.service.fdlimit import raise_fd_limit
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
assert raise_fd_limit() == hard
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
assert raise_fd_limit() == hard  # already there: nothing to do
print("ok")
"""


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_listener_guard_is_off_at_zero() -> None:
    assert start_listener_guard(0.0, CollectorRegistry()) is None


def test_the_listener_guard_counts_on_metrics_and_stops() -> None:
    registry = CollectorRegistry()
    guard = start_listener_guard(10.0, registry)
    assert guard is not None
    try:
        assert registry.get_sample_value("prefill_worker_nixl_silent_connections_closed_total") == 0
        guard.silent.closed = 3
        assert registry.get_sample_value("prefill_worker_nixl_silent_connections_closed_total") == 3
    finally:
        guard.stop()
