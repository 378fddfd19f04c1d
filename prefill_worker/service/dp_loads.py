"""Each attention-DP rank's load: summed for the router's ``pong``, per rank on ``/metrics``
(a ``dp_rank`` label: docs/metrics.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prefill_worker.load import LoadSnapshot

_COUNTS = ("num_bootstrapping", "num_waiting", "num_prefilling", "num_transferring")
_PAGES = ("num_free_pages", "num_total_pages", "num_free_aux_rows", "num_total_aux_rows")
_SUMMED = (*_COUNTS, *_PAGES, "num_cached_pages", "num_used_sliding_pages")


def combined(loads: Sequence[LoadSnapshot]) -> LoadSnapshot:
    """The worker's load as one: requests and pages summed over the ranks; the cost signals
    rank 0's with the queued and running tokens summed."""
    sums = {name: sum(getattr(load, name) for load in loads) for name in _SUMMED}
    costs = dataclasses.replace(
        loads[0].costs,
        queued_tokens=sum(load.costs.queued_tokens for load in loads),
        running_tokens=sum(load.costs.running_tokens for load in loads),
    )
    return LoadSnapshot(**sums, costs=costs)


class DpLoadCollector(Collector):
    """``prefill_worker_dp_requests{dp_rank,state}`` and ``prefill_worker_dp_kv_pages{dp_rank,
    kind}`` from each rank's latest load, read at each scrape."""

    def __init__(self, loads: Callable[[], Sequence[LoadSnapshot]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        requests = GaugeMetricFamily(
            "prefill_worker_dp_requests",
            "Requests on each attention-DP rank, by state (its latest load).",
            labels=["dp_rank", "state"],
        )
        pages = GaugeMetricFamily(
            "prefill_worker_dp_kv_pages",
            "KV pages of each attention-DP rank's pool: free (or idle in the prefix cache) "
            "and total.",
            labels=["dp_rank", "kind"],
        )
        for dp_rank, load in enumerate(self._loads()):
            for name in _COUNTS:
                requests.add_metric([str(dp_rank), name.removeprefix("num_")], getattr(load, name))
            pages.add_metric([str(dp_rank), "free"], load.num_free_pages)
            pages.add_metric([str(dp_rank), "total"], load.num_total_pages)
        yield requests
        yield pages
