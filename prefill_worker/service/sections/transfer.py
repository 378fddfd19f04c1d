"""The ``transfer`` section: the KV push to decode peers, for each protocol served (native,
SGLang's, vLLM's), and ``protocols_of``, which reads its ``protocol`` key."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator

from prefill_worker.service.sections.base import Section
from prefill_worker.transfer.vllm.profiles import DEFAULT_VERSIONS, PROFILES, TRANSFER_MODES

_ANY_ADDRESS = ("", "0.0.0.0", "::")


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


class TransferConfig(Section):
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
    ucx_silent_close_s: float = Field(
        10.0,
        ge=0,
        description="A TCP connection on the NIXL/UCX listener that has sent nothing this long "
        "is shut down (a UCX peer speaks at once; NIXL keeps silent ones open for ever, an fd "
        "each); 0 keeps them.",
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
    sglang_mamba_conv_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="A hybrid model (Qwen3.5, Qwen3-Next): the dtype SGLang decodes keep the "
        "linear layers' conv state in (their SGLANG_MAMBA_CONV_DTYPE, bfloat16 unless set); "
        "this worker stages each request's conv state in it before writing it (docs/sglang.md, "
        "Hybrid models). A decode whose conv slot is another size is refused.",
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
        description="Port of the vLLM side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT) of the "
        "first of vllm_versions; the next version's is this + 1, and so on. 0 picks free ones.",
    )
    vllm_versions: list[str] = Field(
        list(DEFAULT_VERSIONS),
        min_length=1,
        description="The vLLM versions whose decodes this worker serves at once (each hashes its "
        "version, so each has a side channel of its own). A prefill request names its decode's "
        "in `kv_transfer_params.vllm_version`; one that names none gets the first (docs/vllm.md).",
    )
    vllm_transfer_modes: list[str] = Field(
        ["pull"],
        min_length=1,
        description="vLLM's transfer modes served: `pull` (decodes READ staged KV) and `push` "
        "(decodes running vLLM's push connector register their blocks and the worker WRITEs "
        "into them). Each mode has its own side channels (its hash covers it): the pushes' "
        "follow the pulls', one per version (docs/vllm.md).",
    )
    vllm_block_size: int = Field(
        32,
        ge=1,
        description="The vLLM decodes' block size (`--block-size`; a multiple of 32 on vLLM's "
        "CPU backend). Independent of cache.page_size: the forward writes the KV into staging "
        "blocks of this size beside its pages (docs/vllm.md).",
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
    vllm_kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="The vLLM decodes' `kv_cache_dtype`, as their compatibility hash covers it "
        "(the string: `fp8` and `fp8_e4m3` do not pair); `fp8`/`fp8_e4m3` with "
        "cache.kv_dtype fp8_e4m3 and an explicit model.dtype, `auto` otherwise (docs/models.md).",
    )
    vllm_mamba_ssm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="A linear-attention hybrid's (Qwen3-Next, Qwen3.5) vLLM decodes' "
        "`--mamba-ssm-cache-dtype`: the dtype their recurrent state pages hold (float32, "
        "bfloat16, float16; vLLM checks none). `auto`: vLLM's default, the checkpoint's "
        "`mamba_ssm_dtype` (Qwen3.5), else the model dtype (docs/vllm.md).",
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

    @field_validator("vllm_versions")
    @classmethod
    def _vllm_versions_known(cls, versions: list[str]) -> list[str]:
        unknown = [v for v in versions if v not in PROFILES]
        if unknown:
            raise ValueError(f"vllm_versions: no profile for {unknown}; known: {list(PROFILES)}")
        if len(set(versions)) != len(versions):
            raise ValueError(f"vllm_versions: {versions} names a version twice")
        return versions

    @field_validator("vllm_transfer_modes")
    @classmethod
    def _vllm_modes_known(cls, modes: list[str]) -> list[str]:
        if not set(modes) <= set(TRANSFER_MODES) or len(set(modes)) != len(modes):
            raise ValueError(f"vllm_transfer_modes: {modes}; each of {list(TRANSFER_MODES)} once")
        return modes

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
