"""Malformed NIXL notifications from a vLLM-side agent (issue #40, finding 9): any agent that
loaded the worker's metadata can send them, and each was one WARNING line (before: 1,000
notifications, 1,000 lines). Each is counted; the log says the first and then at most one line
per ``BAD_NOTIFICATION_LOG_S`` with how many it left out; the worker serves on."""

from __future__ import annotations

from prefill_worker.transfer.vllm.desk import BAD_NOTIFICATION_LOG_S
from tests.checkpoints import prompt
from tests.integration.daemon.test_vllm_pull import _metric, _prefill, _staging_used, pulled
from tests.polling import wait_until

__all__ = ["pulled"]  # the module's worker and vLLM-shaped decode (test_vllm_pull.py)
MALFORMED = ("prefill_worker_vllm_notifications_ignored_total", '{why="malformed"}')


def test_a_flood_of_malformed_notifications_is_counted_not_logged(pulled) -> None:
    worker, api, decode = pulled
    before = _metric(worker, *MALFORMED)
    lines_before = worker.log().count("notification ignored")
    for i in range(1000):
        decode.notify(f"not a notification {i}")
    wait_until(lambda: _metric(worker, *MALFORMED) == before + 1000, 60, "all 1000 counted")
    lines = worker.log().count("notification ignored") - lines_before
    assert 1 <= lines <= 2, f"{lines} log lines for 1000 notifications"  # 2: an interval passed
    assert BAD_NOTIFICATION_LOG_S >= 10
    params = _prefill(api, prompt(20, seed=7))["kv_transfer_params"]  # still serving
    decode.read(params["remote_block_ids"][0], f"{params['remote_request_id']}:1")
    wait_until(lambda: _staging_used(worker) == 0, 10.0, "the read's release")
