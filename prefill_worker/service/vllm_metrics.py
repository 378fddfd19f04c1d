"""The vLLM pull path's metrics, read at scrape time from the desk that keeps them (engine
thread; reading a few ints from the scrape thread is safe): holds ended by reads or by their
lease, notifications ignored, heartbeats, tokens staged by the forward or by a repack, and
the staging blocks in use (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefill_worker.transfer.vllm.desk import PullDesk
from prefill_worker.transfer.vllm.pusher import VllmPusher
from prefill_worker.transfer.vllm.staging import StagingPool

PUSH_FAILURES = ("handshake", "write", "blocks", "decode_tp")  # pusher.PushCounts.failed keys


class VllmPullCollector(Collector):
    """Registered by start-up when ``vllm`` is served; ``pusher`` when push is too."""

    def __init__(self, desk: PullDesk, pusher: VllmPusher | None = None) -> None:
        self._desk, self._pusher = desk, pusher

    def collect(self) -> Iterator[Metric]:
        counts, staging = self._desk.holds.counts, self._desk.staging
        holds = CounterMetricFamily(
            "prefill_worker_vllm_holds",
            "staged KV holds for vLLM decodes that ended, by how",
            labels=["outcome"],
        )
        holds.add_metric(["read"], counts.released_by_reads)
        holds.add_metric(["expired"], counts.expired)
        yield holds
        ignored = CounterMetricFamily(
            "prefill_worker_vllm_notifications_ignored",
            "NIXL notifications from vLLM decodes that released nothing: unknown hold, malformed, "
            "or from an agent that is not the hold's reader (foreign)",
            labels=["why"],
        )
        ignored.add_metric(["unknown_hold"], counts.unknown_notifications)
        ignored.add_metric(["malformed"], counts.bad_notifications)
        ignored.add_metric(["foreign"], counts.foreign_notifications)
        yield ignored
        yield CounterMetricFamily(
            "prefill_worker_vllm_heartbeats",
            "heartbeat notifications from vLLM decodes",
            value=counts.heartbeats,
        )
        staged = CounterMetricFamily(
            "prefill_worker_vllm_staged_tokens",
            "prompt tokens staged for vLLM decodes, by who wrote them into the blocks",
            labels=["how"],
        )
        staged.add_metric(["mirror"], self._desk.counts.mirrored_tokens)
        staged.add_metric(["repack"], self._desk.counts.repacked_tokens)
        staged.add_metric(["pool"], self._desk.counts.pool_tokens)
        yield staged
        direct = not isinstance(staging, StagingPool)  # a vllm_blocks pool: no staging region
        total = 0 if direct else staging.layout.num_blocks
        yield GaugeMetricFamily(
            "prefill_worker_vllm_staging_blocks_used",
            "staging blocks held for vLLM decodes or being filled",
            value=0 if direct else total - staging.num_free,
        )
        yield GaugeMetricFamily(
            "prefill_worker_vllm_pool_pages_pinned",
            "pool pages kept for vLLM decodes past their requests (a vllm_blocks pool)",
            value=staging.layout.num_blocks - staging.num_free if direct else 0,
        )
        yield GaugeMetricFamily(
            "prefill_worker_vllm_staging_blocks_capacity",
            "staging blocks in the region",
            value=total,
        )
        if self._pusher is not None:
            yield from self._push_metrics(self._pusher)

    def _push_metrics(self, pusher: VllmPusher) -> Iterator[Metric]:
        pushes = CounterMetricFamily(
            "prefill_worker_vllm_pushes",
            "requests whose KV was WRITten into a vLLM push decode's blocks (written), or not, "
            "by why (the decode refused at its handshake, the WRITE failed, its blocks not "
            "ours to fill, a decode TP that does not divide the KV heads)",
            labels=["outcome"],
        )
        pushes.add_metric(["written"], pusher.counts.pushed)
        for why in PUSH_FAILURES:
            pushes.add_metric([why], pusher.counts.failed[why])
        yield pushes
        ignored = CounterMetricFamily(
            "prefill_worker_vllm_push_registrations_ignored",
            "PUSH_REG notifications that started no WRITE, by why",
            labels=["why"],
        )
        for why, count in sorted(self._desk.pushes.refused.items()):
            ignored.add_metric([why], count)
        yield ignored
