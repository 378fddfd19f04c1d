"""The vLLM pull metrics follow the desk: holds by outcome, ignored notifications,
heartbeats, tokens staged by repack (these senders' chunks are not mirrored) and staging blocks
in use, read at scrape time; `promtool check metrics` is clean."""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client import CollectorRegistry, generate_latest

from prefill_worker.service.vllm_metrics import VllmPullCollector
from tests.clocks import FakeClock
from tests.unit.transfer.vllm.test_sender import BLOCKS, _desk, _staged


def test_scrapes_follow_the_desk() -> None:
    clock = FakeClock(100.0)
    desk, _ = _desk(clock)
    registry = CollectorRegistry()
    registry.register(VllmPullCollector(desk))
    _staged(desk, 1, 40)
    hold_id = desk.tickets.take(1)["remote_request_id"]  # type: ignore[index]
    assert registry.get_sample_value("prefill_worker_vllm_staging_blocks_used") == 2
    desk.notify("d0", f"HB:{hold_id}".encode())
    desk.notify("d0", b"nobody:1")
    desk.notify("d0", b"garbage")
    desk.notify("d0", f"{hold_id}:1".encode())
    value = registry.get_sample_value
    assert value("prefill_worker_vllm_holds_total", {"outcome": "read"}) == 1
    assert value("prefill_worker_vllm_holds_total", {"outcome": "expired"}) == 0
    assert value("prefill_worker_vllm_heartbeats_total") == 1
    assert value("prefill_worker_vllm_notifications_ignored_total", {"why": "unknown_hold"}) == 1
    assert value("prefill_worker_vllm_notifications_ignored_total", {"why": "malformed"}) == 1
    assert value("prefill_worker_vllm_staged_tokens_total", {"how": "repack"}) == 40
    assert value("prefill_worker_vllm_staged_tokens_total", {"how": "mirror"}) == 0
    assert value("prefill_worker_vllm_staging_blocks_used") == 0
    assert value("prefill_worker_vllm_staging_blocks_capacity") == BLOCKS
    if shutil.which("promtool"):
        text = generate_latest(registry)
        proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
