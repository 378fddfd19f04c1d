"""Model-load progress: a log line at every tenth of the bytes, with bytes, percent and rate,
and the same words as systemd's STATUS."""

from __future__ import annotations

import itertools
import logging

import pytest

from prefill_worker.service.startup import LoadReport

GIB = 2**30


def test_a_line_per_tenth_with_bytes_and_percent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    now = [0.0]
    statuses: list[str] = []
    report = LoadReport(statuses.append, clock=lambda: now[0])
    total = 16 * GIB
    for num_read in range(GIB // 4, total + 1, GIB // 4):  # 64 tensors of 256 MiB
        now[0] += 0.25
        report(num_read, total)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading")]
    assert lines == statuses
    assert len(lines) == 11  # 1%, then the first call past each tenth, then 100%
    assert lines[0] == "loading model: 0.25 of 16.00 GiB (1%, 1024 MiB/s)"
    assert lines[-1] == "loading model: 16.00 of 16.00 GiB (100%, 1024 MiB/s)"
    percents = [int(line.split("(")[1].split("%")[0]) for line in lines]
    assert percents == sorted(percents) and all(
        p // 10 != q // 10 for p, q in itertools.pairwise(percents)
    )


def test_an_empty_checkpoint_is_done_at_once() -> None:
    statuses: list[str] = []
    LoadReport(statuses.append)(0, 0)
    assert statuses and "(100%" in statuses[0]
