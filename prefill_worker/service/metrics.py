"""The worker's Prometheus metric set (docs/metrics.md), on an injected registry.

Names are ``prefill_worker_*`` in base units, counters end in ``_total``, and no label carries a
request id. ``WorkerMetrics`` is a plain recorder: the daemon forwards engine, ingress and
transfer events to it; nothing here knows those components.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from prefill_worker.load import CostSignals
from prefill_worker.request import Outcome, OutcomeStatus

# Request latencies (TTFT, queue, bootstrap, prefill): vLLM's `time_to_first_token_seconds`
# buckets, 1 ms to 43 min. Dense from 10 ms to 1 s (a GPU prefill), still resolving a minute
# (a long CPU prefill or a queue under overload); and the same `le` values as vLLM's, so the
# recording rules' `vllm:time_to_first_token_seconds` aggregates with vLLM's own series.
LATENCY_BUCKETS_S = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
# KV push after the last chunk: sub-millisecond on RDMA for short prompts, seconds over TCP.
# Holds every bucket of vLLM's `nixl_xfer_time_seconds`.
TRANSFER_BUCKETS_S = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3),
    *(0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0),
)
# One forward batch: ~1 ms (a few tokens on a GPU) to a minute (8k tokens of 8B on a CPU).
STEP_BUCKETS_S = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
# The prompt lengths whose predicted TTFT is a gauge (``prompt_tokens`` label).
PREDICTED_TTFT_TOKENS = (256, 1024, 4096)
_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class WorkerMetrics:
    """Every metric the worker exports, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.info = Info(
            "prefill_worker_build", "Build and model of this worker", registry=registry
        )
        self.requests = Counter(
            "prefill_worker_requests_total",
            "Requests ended, by outcome status and reason",
            ["status", "reason"],
            registry=registry,
        )
        self.rejects = Counter(
            "prefill_worker_rejects_total",
            "Messages answered with a reject, by code",
            ["code"],
            registry=registry,
        )
        self.malformed = Counter(
            "prefill_worker_malformed_messages_total",
            "Frames that were not a readable message (answered with a reject when possible)",
            registry=registry,
        )
        self.unroutable = Counter(
            "prefill_worker_unroutable_replies_total",
            "Replies dropped because their router had disconnected",
            registry=registry,
        )
        self.queue = Gauge(
            "prefill_worker_queue_requests",
            "Requests held, by state",
            ["state"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "prefill_worker_prompt_tokens_total",
            "Prompt tokens of ended requests",
            registry=registry,
        )
        self.cached_tokens = Counter(
            "prefill_worker_cached_tokens_total",
            "Prompt tokens the decode peer already held (not sent)",
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "prefill_worker_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (once per admitted request)",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "prefill_worker_prefix_cache_hits_total",
            "Prompt tokens the prefix cache held (not computed)",
            registry=registry,
        )
        self.prefill_retries = Counter(
            "prefill_worker_prefill_retries_total",
            "Optimistic prefills that yielded before their decode claimed the room (requeued)",
            registry=registry,
        )
        self.prefix_cache_pages = Gauge(
            "prefill_worker_prefix_cache_pages",
            "KV pages held by the prefix cache (in use by requests or idle)",
            registry=registry,
        )
        self.prompt_length = Histogram(
            "prefill_worker_prompt_length_tokens",
            "Prompt length of ended requests",
            buckets=_TOKENS,
            registry=registry,
        )
        self.ttft = Histogram(
            "prefill_worker_time_to_first_token_seconds",
            "Arrival to result of successful requests: first token and KV at the decode peer",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.phase = {
            phase: Histogram(
                f"prefill_worker_{phase}_seconds",
                f"Time requests spent in the {phase} phase",
                buckets=TRANSFER_BUCKETS_S if phase == "transfer" else LATENCY_BUCKETS_S,
                registry=registry,
            )
            for phase in ("queue", "bootstrap", "prefill", "transfer")
        }
        self.kv_pages_used = Gauge(
            "prefill_worker_kv_pages_used", "KV pages held by requests", registry=registry
        )
        self.kv_pages_total = Gauge(
            "prefill_worker_kv_pages_capacity", "KV pages in the pool", registry=registry
        )
        self.sliding_pages_used = Gauge(
            "prefill_worker_sliding_pages_used",
            "Pages of a windowed sliding pool (cache.sliding_pool) held by requests",
            registry=registry,
        )
        self.aux_rows_used = Gauge(
            "prefill_worker_aux_rows_used", "Aux rows held by requests", registry=registry
        )
        self.aux_rows_total = Gauge(
            "prefill_worker_aux_rows_capacity", "Aux rows in the pool", registry=registry
        )
        self.transfer_bytes = Counter(
            "prefill_worker_transfer_bytes_total",
            "KV and aux bytes written to decode peers (writes that landed, any outcome; "
            "every rank's under tensor parallelism)",
            registry=registry,
        )
        self.rank_write_bytes = Counter(
            "prefill_worker_tp_write_bytes_total",
            "Bytes of one rank's writes to decode peers that landed (tensor parallelism; "
            "rank 0's include the aux rows), by rank",
            ["rank"],
            registry=registry,
        )
        self.rank_decode_peers = Gauge(
            "prefill_worker_tp_decode_peers",
            "Decode ranks whose NIXL agent a follower rank holds (tensor parallelism), by rank",
            ["rank"],
            registry=registry,
        )
        self._group_size = 1  # the ranks whose writes are counted (lead_group)
        self.bootstrap_rejects = Counter(
            "prefill_worker_bootstrap_rejects_total",
            "Bootstrap messages or decode peers refused, by reason",
            ["reason"],
            registry=registry,
        )
        self.transfer_failures = Counter(
            "prefill_worker_transfer_failures_total",
            "Requests whose KV push failed, by reason",
            ["reason"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "prefill_worker_step_duration_seconds",
            "Wall time of one forward batch",
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self.rank_forward_seconds = Histogram(
            "prefill_worker_tp_forward_seconds",
            "Wall time of one rank's share of a forward batch (tensor parallelism), by rank",
            ["rank"],
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self.draft_forward_seconds = Histogram(
            "prefill_worker_draft_forward_seconds",
            "Wall time of the draft model's forward over one batch (model.draft), within the step",
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "prefill_worker_batch_tokens",
            "Tokens in one forward batch",
            buckets=_TOKENS,
            registry=registry,
        )
        self.kv_events_published = Counter(
            "prefill_worker_kv_events_published_total",
            "KV events (block stored, removed, all cleared) sent on the kv-events PUB socket",
            registry=registry,
        )
        self.kv_events_dropped = Counter(
            "prefill_worker_kv_events_dropped_total",
            "KV events never sent, by reason",
            ["reason"],
            registry=registry,
        )
        self.kv_event_replays = Counter(
            "prefill_worker_kv_event_replays_total",
            "Replay requests on the kv-events replay socket, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.trace_spans_dropped = Counter(
            "prefill_worker_trace_spans_dropped_total",
            "Request-trace spans never exported (tracer queue full, export failed), by reason",
            ["reason"],
            registry=registry,
        )
        self.warmup_seconds = Gauge(
            "prefill_worker_warmup_seconds",
            "Wall time of the warm-up forward at start-up",
            registry=registry,
        )
        self._add_cost_gauges(registry)
        self.ready = Gauge("prefill_worker_ready", "1 when serving, else 0", registry=registry)
        self.draining = Gauge("prefill_worker_draining", "1 while draining", registry=registry)

    def _add_cost_gauges(self, registry: CollectorRegistry) -> None:
        self.queued_tokens = Gauge(
            "prefill_worker_queued_tokens",
            "Prompt tokens of requests not yet admitted (whole prompts: hits unknown yet)",
            registry=registry,
        )
        self.running_tokens = Gauge(
            "prefill_worker_running_tokens",
            "Tokens the prefilling requests have yet to compute (prefix hits excluded)",
            registry=registry,
        )
        self.prefill_rate = Gauge(
            "prefill_worker_prefill_rate_tokens_per_second",
            "Tokens computed per second over the recent forwards (0 before the first)",
            registry=registry,
        )
        self.backlog_seconds = Gauge(
            "prefill_worker_backlog_seconds",
            "Queued and running tokens over the prefill rate (NaN: work, but no rate yet)",
            registry=registry,
        )
        self.predicted_ttft = Gauge(
            "prefill_worker_predicted_ttft_seconds",
            "Predicted TTFT of a new request of prompt_tokens uncached tokens (NaN: no rate)",
            ["prompt_tokens"],
            registry=registry,
        )
        self.set_costs(CostSignals())

    def set_costs(self, costs: CostSignals) -> None:
        self.queued_tokens.set(costs.queued_tokens)
        self.running_tokens.set(costs.running_tokens)
        self.prefill_rate.set(costs.prefill_rate_tps or 0.0)
        backlog_s = costs.backlog_s
        self.backlog_seconds.set(math.nan if backlog_s is None else backlog_s)
        for num_tokens in PREDICTED_TTFT_TOKENS:
            predicted_s = costs.predicted_ttft_s(num_tokens)
            gauge = self.predicted_ttft.labels(str(num_tokens))
            gauge.set(math.nan if predicted_s is None else predicted_s)

    def observe_outcome(self, outcome: Outcome) -> None:
        self.requests.labels(outcome.status.value, outcome.reason.value).inc()
        self.transfer_bytes.inc(outcome.transfer.bytes)  # landed writes, failed requests too
        if self._group_size > 1:  # the leader's writes: the followers' come by the step
            self.rank_write_bytes.labels(rank="0").inc(outcome.transfer.bytes)
        self.prompt_tokens.inc(outcome.num_prompt_tokens)
        self.cached_tokens.inc(outcome.num_cached_tokens)
        self.prompt_length.observe(outcome.num_prompt_tokens)
        t = outcome.timings
        self.prefill_retries.inc(outcome.prefill_retries)
        for phase, seconds in (
            ("queue", t.queue_s),
            ("bootstrap", t.bootstrap_s),
            ("prefill", t.prefill_s),
            ("transfer", t.transfer_s),
        ):
            self.phase[phase].observe(seconds)
        if outcome.status is OutcomeStatus.OK:
            self.ttft.observe(t.queue_s + t.bootstrap_s + t.prefill_s + t.transfer_s)
        elif outcome.reason.value.startswith(("transfer", "peer")):
            self.transfer_failures.labels(outcome.reason.value).inc()

    def observe_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries.inc(num_query_tokens)
        self.prefix_cache_hits.inc(num_hit_tokens)

    def observe_step(self, duration_s: float, batch_tokens: int) -> None:
        self.step_seconds.observe(duration_s)
        self.batch_tokens.observe(batch_tokens)

    def on_draft_forward(self, seconds: float) -> None:
        self.draft_forward_seconds.observe(seconds)

    def set_queue_sizes(self, sizes: Mapping[str, int]) -> None:
        for state, count in sizes.items():
            self.queue.labels(state).set(count)

    def set_kv_pages(self, used: int, total: int, cached: int = 0) -> None:
        self.kv_pages_used.set(used)
        self.kv_pages_total.set(total)
        self.prefix_cache_pages.set(cached)

    def set_aux_rows(self, used: int, total: int) -> None:
        self.aux_rows_used.set(used)
        self.aux_rows_total.set(total)

    def lead_group(self, size: int) -> None:
        """This worker leads a tensor-parallel group of ``size`` ranks: every rank's written
        bytes series, from 0 (rank 0's from the outcomes, the others' from the steps)."""
        self._group_size = size
        for rank in range(size):
            self.rank_write_bytes.labels(rank=str(rank))
        for rank in range(1, size):
            self.rank_decode_peers.labels(rank=str(rank)).set(0)

    def on_rank_written(self, bytes_by_rank: tuple[int, ...]) -> None:
        """What each rank's writes landed since its last step answer (rank order). Rank 0's
        entry is skipped: the leader's writes are counted per request (``observe_outcome``)."""
        for rank, num_bytes in enumerate(bytes_by_rank[1:], start=1):
            self.rank_write_bytes.labels(rank=str(rank)).inc(num_bytes)
            self.transfer_bytes.inc(num_bytes)

    def on_rank_decode_peers(self, peers_by_rank: tuple[int, ...]) -> None:
        """The decode ranks each follower holds an agent for, at its last step answer (rank
        order; rank 0's entry skipped: the leader's peers are its own backend's)."""
        for rank, num_peers in enumerate(peers_by_rank[1:], start=1):
            self.rank_decode_peers.labels(rank=str(rank)).set(num_peers)

    def on_rank_forward(self, seconds_by_rank: tuple[float, ...]) -> None:
        """One forward's time on each rank of the tensor-parallel group (rank order)."""
        for rank, seconds in enumerate(seconds_by_rank):
            self.rank_forward_seconds.labels(rank=str(rank)).observe(seconds)

    def on_trace_spans_dropped(self, reason: str, num_spans: int) -> None:
        self.trace_spans_dropped.labels(reason).inc(num_spans)

    def on_reject(self, code: str) -> None:
        self.rejects.labels(code).inc()

    def on_bootstrap_reject(self, reason: str) -> None:
        self.bootstrap_rejects.labels(reason).inc()
