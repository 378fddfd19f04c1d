"""Log lines: text or one JSON object per line; the per-request line carries id and timings."""

from __future__ import annotations

import json
import logging

import pytest

from prefill_worker.request import FinishReason, Outcome, OutcomeStatus, Timings
from prefill_worker.service.logs import JsonFormatter, configure_logging, log_outcome


def test_outcome_line_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    try:
        outcome = Outcome(
            "r-1",
            OutcomeStatus.FAILED,
            FinishReason.TRANSFER_TIMEOUT,
            12,
            error="decode peer silent",
            timings=Timings(0.5, 0.25, 0.125, 3.0),
        )
        log_outcome(logging.getLogger("prefill_worker.test"), outcome)
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        configure_logging("warning", "text")
    entry = json.loads(line)
    assert entry["request_id"] == "r-1" and entry["status"] == "failed"
    assert entry["reason"] == "transfer_timeout" and entry["error"] == "decode peer silent"
    assert (entry["queue_s"], entry["bootstrap_s"], entry["prefill_s"], entry["transfer_s"]) == (
        0.5,
        0.25,
        0.125,
        3.0,
    )
    assert entry["level"] == "info" and "request_id=r-1" in entry["msg"]


def test_json_formatter_keeps_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, True)
        import sys

        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "failed" and "ValueError: boom" in entry["exc"]
