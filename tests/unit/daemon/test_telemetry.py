"""The daemon's observers: engine events (written bytes among them) reaching the metrics."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import FinishReason, Outcome, OutcomeStatus, TransferStats
from prefill_worker.service.metrics import WorkerMetrics
from prefill_worker.service.telemetry import EngineEvents, IngressEvents


def test_events_reach_metrics(caplog) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    events = EngineEvents(metrics, logging.getLogger("t"))
    written = 512 + AUX_ROW_BYTES
    with caplog.at_level(logging.INFO, logger="t"):
        events.on_outcome(
            Outcome("req-9", OutcomeStatus.OK, FinishReason.OK, 4, transfer=TransferStats(written))
        )
    assert "request_id=req-9" in caplog.text and "status=ok" in caplog.text
    events.on_step(0.01, 0)  # an idle turn is not a batch
    events.on_step(0.01, 32)
    events.on_load(
        LoadSnapshot(
            num_waiting=2,
            num_free_pages=7,
            num_total_pages=10,
            num_free_aux_rows=5,
            num_total_aux_rows=8,
            num_cached_pages=4,
        )
    )
    events.on_prefix_lookup(40, 24)
    events.on_prefix_lookup(9, 0)
    IngressEvents(metrics).on_malformed()
    IngressEvents(metrics).on_unroutable()
    sample = registry.get_sample_value
    assert sample("prefill_worker_transfer_bytes_total") == written
    assert sample("prefill_worker_batch_tokens_count") == 1
    assert sample("prefill_worker_queue_requests", {"state": "waiting"}) == 2
    assert sample("prefill_worker_kv_pages_used") == 3
    assert sample("prefill_worker_prefix_cache_pages") == 4
    assert sample("prefill_worker_prefix_cache_queries_total") == 49
    assert sample("prefill_worker_prefix_cache_hits_total") == 24
    assert sample("prefill_worker_aux_rows_used") == 3
    assert sample("prefill_worker_aux_rows_capacity") == 8
    assert sample("prefill_worker_malformed_messages_total") == 1
    assert sample("prefill_worker_unroutable_replies_total") == 1
