"""The configuration's schema: one pydantic model per section, with defaults, bounds and the
descriptions ``docs/config.md`` is rendered from. Reading files and env is ``config.py``'s job.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_ANY_ADDRESS = ("", "0.0.0.0", "::")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The checkpoint, its dtype, the device, the attention and MoE experts backends."""

    path: str = Field(
        "models/smollm2-135m",
        description="Hugging Face checkpoint directory (config.json and *.safetensors).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Weight and KV dtype; `auto` takes the checkpoint's torch_dtype."
    )
    device: str = Field("cpu", description="`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA if present).")
    attention_backend: Literal["auto", "sdpa", "flashinfer"] = Field(
        "auto",
        description="`auto` picks flashinfer on CUDA when installed, else sdpa. An MLA model "
        "(DeepSeek-V3) keeps flashinfer only at DeepSeek's MLA dims (rank 512, rope 64, nope "
        "128, v 128) in bf16/fp16, and otherwise runs its torch path (docs/models.md).",
    )
    moe_backend: Literal["auto", "grouped", "naive", "flashinfer"] = Field(
        "auto",
        description=(
            "Experts of a mixture-of-experts model: `grouped` (tokens grouped by expert, torch "
            "ops, any device), `flashinfer` (fused kernel; CUDA, bf16/fp16), `naive` (every "
            "expert over every token; a baseline). `auto` picks flashinfer on CUDA in bf16/fp16 "
            "when installed, else grouped. Unused by dense models, but checked against the device."
        ),
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads on CPU; unset leaves torch's default."
    )


class CacheConfig(_Section):
    """The paged KV pool (layout: docs/protocol.md, part 2) and the aux rows."""

    page_size: int = Field(16, ge=1, le=1024, description="Tokens per KV page.")
    num_pages: int | None = Field(
        1024, ge=1, description="KV pages per layer; unset sizes the pool from the byte budget."
    )
    memory_bytes: int | None = Field(
        None, ge=1, description="KV byte budget (all layers, K and V) when num_pages is unset."
    )
    memory_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="On CUDA: fraction of free device memory for KV when both above are unset.",
    )
    num_aux_rows: int = Field(
        256, ge=1, description="Metadata rows (first token, logprob) for requests in flight."
    )
    layout: Literal["layer_major", "page_major"] = Field(
        "layer_major",
        description=(
            "KV pool layout: `layer_major` (each layer's K and V its own region) or "
            "`page_major` (every layer's K and V of a page together: one transfer descriptor "
            "per run of pages). Decode pools must use the same. An MLA model (DeepSeek-V3) "
            "always gets the `mla` pool (one latent row per token and layer; docs/models.md) "
            "and refuses `page_major`."
        ),
    )
    prefix_caching: bool = Field(
        True,
        description="Keep full KV pages after their request and share them with later prompts "
        "that start with the same tokens (docs/prefix-cache.md).",
    )
    prefix_cache_max_pages: int | None = Field(
        None,
        ge=0,
        description="Most KV pages the prefix cache holds; unset: as many as the pool has (idle "
        "cached pages are evicted, least recently used first, when requests need them).",
    )

    @model_validator(mode="after")
    def _one_size(self) -> CacheConfig:
        if self.num_pages is None and self.memory_bytes is None and self.memory_fraction is None:
            raise ValueError("set one of num_pages, memory_bytes or memory_fraction")
        return self


class SchedulerConfig(_Section):
    """Admission, chunking, deadlines and the overlap strategy."""

    chunk_size: int = Field(512, ge=1, description="Most prompt tokens of one request per step.")
    max_batch_tokens: int = Field(2048, ge=1, description="Token budget of one forward batch.")
    max_running_requests: int = Field(64, ge=1, description="Requests prefilling at once.")
    max_prompt_tokens: int = Field(8192, ge=1, description="Longest prompt accepted.")
    max_queued_requests: int = Field(
        4096, ge=1, description="Requests held (all states) before new ones are rejected."
    )
    bootstrap_timeout_s: float = Field(
        30.0, gt=0, description="Deadline for the decode peer's handshake."
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="Deadline for pushing a request's KV once its prefill ends."
    )
    overlap: bool = Field(
        True, description="Run forward N while the CPU schedules N+1 (CUDA stream or thread)."
    )
    optimistic_prefill: bool = Field(
        False,
        description="Prefill a request before its decode claims the room; its pages are pushed "
        "when the claim comes (docs/architecture.md, optimistic prefill).",
    )
    optimistic_attempts: int = Field(
        2,
        ge=1,
        description="Prefills a request may start before its decode claims the room; after "
        "that it waits for the claim.",
    )
    optimistic_hold_s: float = Field(
        1.0,
        gt=0,
        description="How long a finished optimistic prefill keeps its pages for its decode's "
        "claim before it yields them to the prefix cache and is requeued.",
    )
    warmup_tokens: int = Field(
        256,
        ge=0,
        description="Tokens of the dummy prompt run once before the worker is ready, in chunks "
        "of at most chunk_size (first-use kernel compiles and allocations happen then, not on "
        "a request); 0: none.",
    )


class AdmissionConfig(_Section):
    """Admission on the fronts, before a request enters the engine."""

    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        description="Refuse a request whose predicted TTFT (docs/metrics.md) exceeds this "
        "many seconds: 429 on the HTTP API, `overloaded` on the ZMQ ingress. Unset: off.",
    )


class IngressConfig(_Section):
    """The ZMQ ROUTER socket routers send requests to (docs/protocol.md, part 1)."""

    bind: str = Field("tcp://127.0.0.1:5557", description="ZMQ ROUTER address routers connect to.")
    max_message_bytes: int | None = Field(
        None,
        ge=1024,
        description="Larger frames make ZMQ drop the connection; unset: what the longest prompt "
        "needs (4 × scheduler.max_prompt_tokens + 64 KiB).",
    )
    allow_drain_message: bool = Field(
        False,
        description="Honour the router `drain` message; off, it is refused with `forbidden` "
        "(any router could stop the worker). SIGTERM drains either way.",
    )
    heartbeat_interval_s: float = Field(5.0, gt=0, description="ZMTP heartbeat interval.")
    heartbeat_timeout_s: float = Field(15.0, gt=0, description="ZMTP heartbeat timeout.")
    curve_secret_key_file: str | None = Field(
        None, description="CurveZMQ server secret key file; unset disables CURVE."
    )
    curve_authorized_keys_dir: str | None = Field(
        None, description="Directory of allowed client public keys (with CURVE)."
    )


PROTOCOLS = ("native", "sglang", "vllm")


def protocols_of(protocol: str) -> tuple[str, ...]:
    """``transfer.protocol`` as protocol names in ``PROTOCOLS`` order (``ValueError`` for an
    unknown or repeated name)."""
    names = [n.strip() for n in protocol.split(",")]
    names = [m for n in names for m in (("native", "sglang") if n == "both" else (n,))]
    unknown = [n for n in names if n not in PROTOCOLS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(
            f"protocol {protocol!r}: comma-separated names of {', '.join(PROTOCOLS)} (or "
            "both), each once"
        )
    return tuple(n for n in PROTOCOLS if n in names)


class TransferConfig(_Section):
    """KV push to decode peers: the bootstrap server and NIXL (docs/protocol.md, part 2)."""

    backend: Literal["nixl"] = Field(
        "nixl", description="The transfer backend: `nixl` (test fakes are not selectable)."
    )
    bootstrap_bind: str = Field(
        "tcp://127.0.0.1:5558", description="ZMQ ROUTER address decode peers register with."
    )
    agent_name: str | None = Field(None, description="NIXL agent name; unset derives one.")
    nixl_backends: list[str] = Field(["UCX"], description="NIXL backends to create.")
    peer_timeout_s: float = Field(
        10.0, gt=0, description="A decode peer silent this long fails its requests."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Heartbeat period to peers.")
    max_peer_pages: int = Field(
        2**20,
        ge=1,
        description="Most decode pool pages (and aux rows) one peer may register; larger "
        "registrations are refused (bounds what a want may name and the descriptor indices).",
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest bootstrap message; ZMQ drops larger ones and their connection "
        "(a `register` of 80 layers is ~9 KiB; a `want` is 4 bytes per prompt page).",
    )
    curve_secret_key_file: str | None = Field(
        None, description="CurveZMQ secret key file of the bootstrap socket; unset disables."
    )
    curve_authorized_keys_dir: str | None = Field(
        None, description="Directory of allowed decode public keys (with CURVE)."
    )
    ucx_net_devices: str | None = Field(
        None,
        description="UCX_NET_DEVICES for the NIXL agent (`lo`, `eth0`, `mlx5_0:1`, `all`): the "
        "interfaces UCX listens on and sends over. Unset: `lo` when bootstrap_bind is on "
        "127.0.0.1, else UCX's default (every interface).",
    )
    protocol: str = Field(
        "native",
        description="Which decodes the worker serves: `native` (the bootstrap protocol of "
        "docs/protocol.md, on bootstrap_bind), `sglang` (SGLang PD decode servers, "
        "docs/sglang.md, on the sglang_* addresses), `vllm` (vLLM decodes that pull their KV, "
        "docs/vllm.md, on the vllm_* addresses; needs `http_api.enabled`), or several at once, "
        "comma-separated (`native,sglang,vllm`); `both` is `native,sglang`.",
    )
    sglang_bootstrap_bind: str = Field(
        "127.0.0.1:8998",
        description="host:port of SGLang's bootstrap routes (`/route`, `/health`): the port "
        "given to the router as `--prefill URL PORT` (SGLang's default is 8998).",
    )
    sglang_rank_ip: str | None = Field(
        None,
        description="Address of the SGLang control socket, as `/route` tells decodes (it binds "
        "there). Unset: the host of sglang_bootstrap_bind, which must then be a specific "
        "address.",
    )
    sglang_rank_port: int = Field(
        0, ge=0, le=65535, description="Port of the SGLang control socket; 0 picks a free one."
    )
    sglang_kv_cache_dtype: str = Field(
        "auto",
        description="What `/route` announces as `kv_cache_dtype`; SGLang decodes refuse a "
        "prefill whose string differs from their `--kv-cache-dtype`.",
    )
    sglang_health_stale_s: float = Field(
        30.0,
        gt=0,
        description="SGLang `/health` answers 503 once the engine loop has not turned for this "
        "long (decodes fail their rooms after two missed health checks).",
    )
    sglang_rejoin_s: float = Field(
        15.0,
        ge=0,
        description="For this long after the engine starts, SGLang `/health` and `/route` "
        "answer 503, so that every decode that knew a previous run of this worker misses its "
        "heartbeats, drops that run's registration and registers afresh (docs/sglang.md, "
        "Restarts). Keep it above the decodes' SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL x "
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE (5 s x 2 by default); 0 turns it off.",
    )

    sglang_allowed_networks: list[str] = Field(
        [],
        description="Networks (CIDR, e.g. `10.0.0.0/16`) SGLang decodes may connect from; a "
        "control frame from elsewhere is dropped and counted (`network_not_allowed`). Empty: "
        "any network. Every frame's ip must also be its connection's address (docs/sglang.md).",
    )
    vllm_side_channel_host: str = Field(
        "127.0.0.1",
        description="Address of the vLLM side channel (where decodes fetch this worker's NIXL "
        "metadata); the HTTP answer's `remote_host`, so it must be one decodes reach.",
    )
    vllm_side_channel_port: int = Field(
        5600,
        ge=0,
        le=65535,
        description="Port of the vLLM side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT); 0 picks "
        "a free one.",
    )
    vllm_block_size: int = Field(
        32,
        ge=1,
        description="The vLLM decodes' block size (`--block-size`; a multiple of 32 on vLLM's "
        "CPU backend). Independent of cache.page_size: the KV is repacked (docs/vllm.md).",
    )
    vllm_staging_blocks: int = Field(
        256,
        ge=1,
        description="Staging blocks for vLLM pulls: the most KV held for vLLM decodes at once "
        "(each block is vllm_block_size tokens of every layer; docs/vllm.md sizes it).",
    )
    vllm_lease_s: float = Field(
        30.0,
        gt=0,
        description="How long staged KV waits for a vLLM decode to read it (vLLM's "
        "`kv_lease_duration`); each heartbeat extends it to two thirds of this from then.",
    )
    vllm_read_grace_s: float = Field(
        5.0,
        ge=0,
        description="After a lease ends, its blocks wait this long more before reuse (a READ "
        "posted just before the end may still be in flight).",
    )
    vllm_model: str | None = Field(
        None,
        description="The model string vLLM decodes were started with (their compatibility hash "
        "covers it); unset: http_api.served_model_name, else model.path.",
    )
    vllm_attention_backend: str = Field(
        "FLASH_ATTN",
        description="The vLLM decodes' attention backend name, as their compatibility hash "
        "covers it: `FLASH_ATTN` on GPU, `CPU_ATTN` on CPU.",
    )
    vllm_engine_id: str | None = Field(
        None,
        description="The engine id vLLM decodes know this worker by (`remote_engine_id`); "
        "unset: a generated one per start.",
    )

    @field_validator("protocol")
    @classmethod
    def _protocol_names(cls, protocol: str) -> str:
        protocols_of(protocol)
        return protocol

    @field_validator("sglang_allowed_networks")
    @classmethod
    def _networks_parse(cls, networks: list[str]) -> list[str]:
        for network in networks:
            try:
                ipaddress.ip_network(network)
            except ValueError as exc:
                raise ValueError(f"sglang_allowed_networks: {exc}") from None
        return networks

    @model_validator(mode="after")
    def _sglang_rank_ip_known(self) -> TransferConfig:
        if "sglang" in self.protocols and self.resolved_sglang_rank_ip in _ANY_ADDRESS:
            raise ValueError(
                "sglang_rank_ip: set the address decodes reach the control socket on "
                f"(sglang_bootstrap_bind {self.sglang_bootstrap_bind} names no single address)"
            )
        return self

    @property
    def protocols(self) -> tuple[str, ...]:
        """The protocols served, in ``PROTOCOLS`` order (the engine sleeps in the first's)."""
        return protocols_of(self.protocol)

    @property
    def resolved_sglang_rank_ip(self) -> str:
        if self.sglang_rank_ip is not None:
            return self.sglang_rank_ip
        return self.sglang_bootstrap_bind.rpartition(":")[0].strip("[]")

    @property
    def resolved_sglang_ucx_net_devices(self) -> str | None:
        """As ``resolved_ucx_net_devices``, for the SGLang agent: `lo` on 127.0.0.1."""
        if self.ucx_net_devices is not None:
            return self.ucx_net_devices
        return "lo" if self.resolved_sglang_rank_ip == "127.0.0.1" else None

    @property
    def resolved_ucx_net_devices(self) -> str | None:
        """What the NIXL agent gets; None leaves UCX_NET_DEVICES to the environment."""
        if self.ucx_net_devices is not None:
            return self.ucx_net_devices
        return "lo" if "//127.0.0.1:" in self.bootstrap_bind else None


class MetricsConfig(_Section):
    """The HTTP endpoint: /metrics, /livez, /readyz, /drain."""

    bind: str = Field("127.0.0.1:9400", description="host:port of /metrics /livez /readyz /drain.")
    livez_stale_s: float = Field(
        5.0,
        gt=0,
        description="/livez fails when the engine loop has not turned for this long and no "
        "forward is running.",
    )
    livez_forward_floor_s: float = Field(
        60.0,
        gt=0,
        description="A running forward counts as busy, not stuck, for at least this long (the "
        "whole bound before the first forward has been timed).",
    )
    livez_forward_margin: float = Field(
        4.0,
        ge=1.0,
        description="A running forward is stuck once it has run this many times its expected "
        "time (its tokens × the measured seconds per token of recent forwards).",
    )
    admin_token_file: str | None = Field(
        None,
        description="File holding the bearer token that POST /drain needs "
        "(`Authorization: Bearer <token>`); unset, /drain answers 403.",
    )
    allow_unauthenticated_admin: bool = Field(
        False,
        description="Let anyone who reaches metrics.bind POST /drain without a token "
        "(local demos only).",
    )


class HttpApiConfig(_Section):
    """The HTTP API front: what SGLang's PD routers (smg) send a prefill server (docs/sglang.md).
    It runs beside the ZMQ ingress and feeds the same engine."""

    enabled: bool = Field(False, description="Serve the HTTP API (the ZMQ ingress stays on too).")
    bind: str = Field(
        "127.0.0.1:30000", description="host:port of /generate, /v1/completions and the probes."
    )
    served_model_name: str | None = Field(
        None,
        description="The model id announced on /v1/models and /server_info; the router pairs "
        "prefill and decode servers by it. Unset: model.path.",
    )
    max_inflight_requests: int = Field(
        4096, ge=1, description="Prompts in flight through this front before it answers 429."
    )
    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest request body; larger ones get 413."
    )


class KVEventsConfig(_Section):
    """Cached blocks told to cache-aware routers: vLLM's KV events on ZMQ (docs/kv-events.md)."""

    enabled: bool = Field(False, description="Publish KV events.")
    publish_bind: str = Field(
        "tcp://127.0.0.1:5559",
        description="ZMQ PUB address subscribers (Dynamo's indexer, llm-d) connect to; always "
        "bound. Port 0 picks one (`/readyz` shows it as `kv_events`).",
    )
    replay_bind: str | None = Field(
        "tcp://127.0.0.1:5560",
        description="ZMQ ROUTER address that resends held batches from a sequence number "
        "(`kv_events_replay` in `/readyz`); unset: no replay.",
    )
    topic: str = Field("", description="The first frame of every message (vLLM's `topic`).")
    num_replay_batches: int = Field(
        10_000, ge=1, description="Batches held for replay (vLLM's `buffer_steps`)."
    )
    max_queued_events: int = Field(
        100_000,
        ge=1,
        description="Events waiting for the publisher thread; past this they are dropped "
        "(counted), and subscribers are told to clear once the queue drains.",
    )


class DaemonConfig(_Section):
    """Process lifecycle and logging."""

    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM or /drain, how long in-flight requests may finish."
    )
    drain_min_s: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM or /drain, the least time the worker stays up answering 503 "
        "(health and new requests), even when idle, so that a router that health-checks it "
        "(smg) sees the drain before the port closes; set it to the router's health window "
        "(docs/deploy.md). `drain_timeout_s` still ends the drain.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Least severe log level written."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    ready_file: str | None = Field(
        None,
        description="Once serving, write the bound endpoints here as JSON (as `/readyz` shows"
        " them; replaced atomically, removed at exit). `serve --ready-file PATH` sets it.",
    )


class ParallelConfig(_Section):
    """Tensor parallelism: one worker over ``tp_size`` rank processes (docs/parallelism.md)."""

    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks behind this worker; `serve` starts them itself "
        "(under torchrun, RANK/WORLD_SIZE decide instead). Must split the attention heads. "
        "Above 1, `transfer.protocol` must be native or sglang alone.",
    )
    step_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait for any rank in one collective (a step, a heartbeat): a rank "
        "silent that long (stopped, hung) fails the whole worker.",
    )
    heartbeat_interval_s: float = Field(
        1.0,
        gt=0,
        description="While idle, the leader exchanges a heartbeat step with every rank this "
        "often (must be below step_timeout_s).",
    )
    rendezvous_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest wait for every rank to join the group at start-up (and to load).",
    )

    @model_validator(mode="after")
    def _heartbeat_below_timeout(self) -> ParallelConfig:
        if self.heartbeat_interval_s >= self.step_timeout_s:
            raise ValueError("heartbeat_interval_s must be below step_timeout_s")
        return self


class Config(_Section):
    """The whole configuration; only the daemon sees all of it."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    ingress: IngressConfig = IngressConfig()
    transfer: TransferConfig = TransferConfig()
    metrics: MetricsConfig = MetricsConfig()
    http_api: HttpApiConfig = HttpApiConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    parallel: ParallelConfig = ParallelConfig()
    daemon: DaemonConfig = DaemonConfig()

    @model_validator(mode="after")
    def _vllm_needs_the_http_front(self) -> Config:
        if "vllm" in self.transfer.protocols and not self.http_api.enabled:
            raise ValueError(
                "transfer.protocol vllm: vLLM's proxy reaches this worker over HTTP; set "
                "http_api.enabled"
            )
        return self

    @model_validator(mode="after")
    def _tp_serves_one_push_protocol(self) -> Config:
        """At TP > 1 only a desk that leads the group has every rank push its heads (native,
        or SGLang's, alone: docs/parallelism.md); any other choice would offer decodes the
        leader's heads only."""
        protocols = self.transfer.protocols
        if self.parallel.tp_size > 1 and protocols not in (("native",), ("sglang",)):
            raise ValueError(
                f"transfer.protocol {self.transfer.protocol!r} at parallel.tp_size "
                f"{self.parallel.tp_size}: a tensor-parallel worker serves native or sglang alone"
            )
        return self


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Config.model_fields.items()
}
