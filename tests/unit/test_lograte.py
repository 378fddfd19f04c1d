"""``RateLimitedLog``: the first line, then at most one per interval, naming what it left out."""

from __future__ import annotations

import logging

import pytest

from prefill_worker.lograte import RateLimitedLog


def test_one_line_per_interval_with_the_count_left_out(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("t"), 10.0)
    with caplog.at_level(logging.WARNING, "t"):
        assert limited.warning(100.0, "bad %d", 1)
        assert not any(limited.warning(100.0 + i, "bad %d", i) for i in range(1, 10))
        assert limited.num_suppressed == 9
        assert limited.warning(110.0, "bad %d", 10)
        assert not limited.warning(119.9, "bad %d", 11)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 1",
        "bad 10 (9 more like it not logged)",
    ]
    assert limited.num_suppressed == 1
