"""Waiting in tests for what another thread or process will make true: poll a condition with
a deadline (never a bare sleep standing in for synchronisation)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.patience import patient


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``condition`` until true, for up to ``patient(timeout_s)`` (tests/patience.py)."""
    limit_s = patient(timeout_s)
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s:g} s waiting for {what or 'condition'}")
        time.sleep(0.002)
