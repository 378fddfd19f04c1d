"""The daemon's observers: pushed-byte accounting and engine events reaching the metrics."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVLayout
from prefill_worker.metrics import WorkerMetrics
from prefill_worker.observers import EngineEvents, IngressEvents, PushedBytes
from prefill_worker.request import FinishReason, Outcome, OutcomeStatus
from prefill_worker.scheduler import LoadSnapshot

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4, num_pages=10
)  # page_bytes = 4 * 2 * 8 * 2 = 128


def test_pushed_bytes_skip_cached_pages() -> None:
    sizes = PushedBytes.of(LAYOUT)
    assert sizes.per_page == 2 * 2 * 128
    outcome = Outcome(
        "a", OutcomeStatus.OK, FinishReason.OK, num_prompt_tokens=10, num_cached_tokens=4
    )
    assert sizes.pushed(outcome) == 2 * 512 + AUX_ROW_BYTES  # pages 1 and 2 of 0..2


def test_events_reach_metrics(caplog) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    events = EngineEvents(metrics, PushedBytes.of(LAYOUT), logging.getLogger("t"))
    with caplog.at_level(logging.INFO, logger="t"):
        events.on_outcome(Outcome("req-9", OutcomeStatus.OK, FinishReason.OK, 4))
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
        )
    )
    IngressEvents(metrics).on_malformed()
    IngressEvents(metrics).on_unroutable()
    sample = registry.get_sample_value
    assert sample("prefill_worker_transfer_bytes_total") == 512 + AUX_ROW_BYTES
    assert sample("prefill_worker_batch_tokens_count") == 1
    assert sample("prefill_worker_queue_requests", {"state": "waiting"}) == 2
    assert sample("prefill_worker_kv_pages_used") == 3
    assert sample("prefill_worker_aux_rows_used") == 3
    assert sample("prefill_worker_aux_rows_capacity") == 8
    assert sample("prefill_worker_malformed_messages_total") == 1
    assert sample("prefill_worker_unroutable_replies_total") == 1
