"""The sections of the sockets and servers other processes reach, the transfer's aside: the
router ingress, the HTTP endpoints (probes and metrics, the API front), the KV-event publisher."""

from __future__ import annotations

from pydantic import Field

from prefill_worker.service.sections.base import Section


class IngressConfig(Section):
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


class MetricsConfig(Section):
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


class HttpApiConfig(Section):
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


class KVEventsConfig(Section):
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
