"""An attention-DP worker's load: summed over the ranks for the router's ``pong``; per rank,
with a ``dp_rank`` label, on ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from prefill_worker.load import CostSignals, LoadSnapshot
from prefill_worker.service.dp_loads import DpLoadCollector, combined

RANK0 = LoadSnapshot(
    num_waiting=2, num_prefilling=1, num_free_pages=10, num_total_pages=16, num_free_aux_rows=3,
    num_total_aux_rows=4, num_cached_pages=5,
    costs=CostSignals(queued_tokens=7, running_tokens=3, prefill_rate_tps=100.0, chunk_size=64),
)  # fmt: skip
RANK1 = LoadSnapshot(
    num_bootstrapping=4, num_transferring=1, num_free_pages=16, num_total_pages=16,
    num_free_aux_rows=4, num_total_aux_rows=4,
    costs=CostSignals(queued_tokens=11, prefill_rate_tps=50.0),
)  # fmt: skip


def test_the_worker_load_sums_requests_pages_and_tokens() -> None:
    both = combined([RANK0, RANK1])
    assert (both.num_bootstrapping, both.num_waiting, both.num_prefilling) == (4, 2, 1)
    assert both.num_transferring == 1 and both.num_live == 8
    assert (both.num_free_pages, both.num_total_pages, both.num_cached_pages) == (26, 32, 5)
    assert (both.num_free_aux_rows, both.num_total_aux_rows) == (7, 8)
    assert (both.costs.queued_tokens, both.costs.running_tokens) == (18, 3)
    assert both.costs.prefill_rate_tps == 100.0 and both.costs.chunk_size == 64  # rank 0's
    assert combined([RANK1]) == RANK1


def test_metrics_carry_each_ranks_load() -> None:
    registry = CollectorRegistry()
    registry.register(DpLoadCollector(lambda: [RANK0, RANK1]))
    text = generate_latest(registry).decode()
    assert 'prefill_worker_dp_requests{dp_rank="0",state="waiting"} 2.0' in text
    assert 'prefill_worker_dp_requests{dp_rank="1",state="bootstrapping"} 4.0' in text
    assert 'prefill_worker_dp_requests{dp_rank="1",state="transferring"} 1.0' in text
    assert 'prefill_worker_dp_kv_pages{dp_rank="0",kind="free"} 10.0' in text
    assert 'prefill_worker_dp_kv_pages{dp_rank="1",kind="total"} 16.0' in text
