"""The metric set: names, units, labels; `promtool check metrics` is clean."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prefill_worker.load import TTFT_SLO_REJECT, CostSignals
from prefill_worker.request import FinishReason, Outcome, OutcomeStatus, Timings, TransferStats
from prefill_worker.service.metrics import WorkerMetrics

RANK_BYTES = "prefill_worker_tp_write_bytes_total"


def filled() -> tuple[CollectorRegistry, WorkerMetrics]:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    ok = Outcome(
        "a",
        OutcomeStatus.OK,
        FinishReason.OK,
        100,
        32,
        7,
        -0.5,
        None,
        Timings(0.01, 0.02, 0.3, 0.04),
        transfer=TransferStats(4096),
        prefill_retries=2,
    )
    failed = Outcome("b", OutcomeStatus.FAILED, FinishReason.TRANSFER_TIMEOUT, 50, error="x")
    metrics.observe_outcome(ok)
    metrics.observe_outcome(failed)
    metrics.observe_step(0.02, 128)
    metrics.set_queue_sizes({"waiting": 3, "prefilling": 1})
    metrics.set_kv_pages(10, 100, 6)
    metrics.observe_prefix_lookup(100, 64)
    metrics.on_reject("empty_prompt")
    metrics.on_reject(TTFT_SLO_REJECT)
    metrics.set_costs(CostSignals(300, 100, 200.0, handshake_s=0.5, transfer_s=0.25))
    return registry, metrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    assert got is not None, name
    return got


def test_values() -> None:
    registry, _ = filled()
    assert value(registry, "prefill_worker_requests_total", status="ok", reason="ok") == 1
    assert value(registry, "prefill_worker_prompt_tokens_total") == 150
    assert value(registry, "prefill_worker_cached_tokens_total") == 32
    assert value(registry, "prefill_worker_transfer_bytes_total") == 4096
    assert value(registry, "prefill_worker_transfer_failures_total", reason="transfer_timeout") == 1
    assert value(registry, "prefill_worker_time_to_first_token_seconds_count") == 1
    assert value(registry, "prefill_worker_time_to_first_token_seconds_sum") == pytest.approx(0.37)
    assert value(registry, "prefill_worker_queue_requests", state="waiting") == 3
    assert value(registry, "prefill_worker_kv_pages_capacity") == 100
    assert value(registry, "prefill_worker_prefix_cache_pages") == 6
    assert value(registry, "prefill_worker_prefix_cache_queries_total") == 100
    assert value(registry, "prefill_worker_prefix_cache_hits_total") == 64
    assert value(registry, "prefill_worker_prefill_retries_total") == 2
    assert value(registry, "prefill_worker_rejects_total", code="empty_prompt") == 1
    assert value(registry, "prefill_worker_rejects_total", code="ttft_slo") == 1


def test_cost_signals() -> None:
    registry, _ = filled()
    assert value(registry, "prefill_worker_queued_tokens") == 300
    assert value(registry, "prefill_worker_running_tokens") == 100
    assert value(registry, "prefill_worker_prefill_rate_tokens_per_second") == 200.0
    assert value(registry, "prefill_worker_backlog_seconds") == pytest.approx(2.0)
    predicted = value(registry, "prefill_worker_predicted_ttft_seconds", prompt_tokens="1024")
    # the 100 running tokens' forward half gone on average, then the 300 queued, then its own
    assert predicted == pytest.approx(0.5 / 2 + 1.5 + 1024 / 200.0 + 0.25)


def test_cost_signals_of_a_cold_worker() -> None:
    """Before the first forward: idle is no backlog; work without a rate is NaN (unknown)."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    assert value(registry, "prefill_worker_backlog_seconds") == 0.0
    assert value(registry, "prefill_worker_prefill_rate_tokens_per_second") == 0.0
    predicted = value(registry, "prefill_worker_predicted_ttft_seconds", prompt_tokens="256")
    assert math.isnan(predicted)
    metrics.set_costs(CostSignals(queued_tokens=10))
    assert math.isnan(value(registry, "prefill_worker_backlog_seconds"))


def test_a_group_counts_every_ranks_writes_in_the_total_and_by_rank() -> None:
    """TP 3: the leader's writes come with each request's outcome, the followers' with each
    step's replies (whose rank-0 entry is the leader's 0: never counted twice)."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.lead_group(3)
    assert [value(registry, RANK_BYTES, rank=str(r)) for r in range(3)] == [0, 0, 0]
    metrics.on_rank_written((0, 300, 0))
    metrics.observe_outcome(
        Outcome("a", OutcomeStatus.OK, FinishReason.OK, 4, transfer=TransferStats(500))
    )
    metrics.on_rank_written((7, 200, 100))  # rank 0's entry is not a byte count
    assert [value(registry, RANK_BYTES, rank=str(r)) for r in range(3)] == [500, 500, 100]
    assert value(registry, "prefill_worker_transfer_bytes_total") == 1100


def test_a_group_shows_each_followers_decode_peers_as_last_answered() -> None:
    """TP 3: a gauge per follower from 0, set by each step's replies (rank 0's entry, the
    leader's 0, is not a follower's)."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.lead_group(3)
    peers = "prefill_worker_tp_decode_peers"
    assert [registry.get_sample_value(peers, {"rank": str(r)}) for r in range(3)] == [None, 0, 0]
    metrics.on_rank_decode_peers((9, 4, 2))
    metrics.on_rank_decode_peers((9, 1, 2))  # a follower forgot three decode ranks
    assert [registry.get_sample_value(peers, {"rank": str(r)}) for r in range(3)] == [None, 1, 2]


def test_a_worker_of_tp_1_has_no_rank_series() -> None:
    registry, _ = filled()
    assert registry.get_sample_value(RANK_BYTES, {"rank": "0"}) is None
    assert registry.get_sample_value("prefill_worker_tp_decode_peers", {"rank": "1"}) is None


def test_names_follow_the_house_rules() -> None:
    registry, _ = filled()
    for family in registry.collect():
        assert family.name.startswith("prefill_worker_")
        for sample in family.samples:
            assert "request_id" not in sample.labels


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_is_clean() -> None:
    registry, _ = filled()
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=generate_latest(registry), capture_output=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == b"" and proc.stderr.strip() == b""
