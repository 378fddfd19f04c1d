"""The worker's configuration: pydantic models, and the one place that reads files and env.

Load order (later wins): the YAML file, then ``PREFILL_WORKER_<SECTION>__<KEY>`` environment
variables, then ``--set section.key=value`` flags from the CLI. Unknown keys anywhere are errors
that name the key. Every problem is collected and reported at once, one line each, as a
``ConfigError`` whose ``problems`` the CLI prints before exiting with ``EX_CONFIG`` (78).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "PREFILL_WORKER_"
EX_CONFIG = 78


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The checkpoint, its dtype, the device and the attention backend."""

    path: str = Field(
        "models/smollm2-135m",
        description="Hugging Face checkpoint directory (config.json and *.safetensors).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Weight and KV dtype; `auto` takes the checkpoint's torch_dtype."
    )
    device: str = Field("cpu", description="`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA if present).")
    attention_backend: Literal["auto", "sdpa", "flashinfer"] = Field(
        "auto", description="`auto` picks flashinfer on CUDA when installed, else sdpa."
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads on CPU; unset leaves torch's default."
    )


class CacheConfig(_Section):
    """The paged KV pool (DESIGN §5 layout) and the aux rows."""

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


class IngressConfig(_Section):
    """The ZMQ ROUTER socket routers send requests to (DESIGN §4)."""

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


class TransferConfig(_Section):
    """KV push to decode peers: the bootstrap server and NIXL (DESIGN §5)."""

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
        "registrations are refused (the descriptor list is built on the engine thread).",
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
        5.0, gt=0, description="/livez fails when the engine loop has not turned for this long."
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


class DaemonConfig(_Section):
    """Process lifecycle and logging."""

    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM or /drain, how long in-flight requests may finish."
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


class Config(_Section):
    """The whole configuration; only the daemon sees all of it."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    ingress: IngressConfig = IngressConfig()
    transfer: TransferConfig = TransferConfig()
    metrics: MetricsConfig = MetricsConfig()
    daemon: DaemonConfig = DaemonConfig()


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Config.model_fields.items()
}


class ConfigError(Exception):
    """One or more problems with the configuration; each is one printable line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class _Override:
    path: tuple[str, str]
    value: Any
    source: str


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> Config:
    """Resolve file → env → ``section.key=value`` overrides into a validated ``Config``."""
    problems: list[str] = []
    data = _read_file(path, problems) if path is not None else {}
    layered = [
        *_env_overrides(os.environ if env is None else env, problems),
        *_flag_overrides(overrides, problems),
    ]
    sources: dict[tuple[str, ...], str] = {}
    for item in layered:
        section = data.setdefault(item.path[0], {})
        if not isinstance(section, dict):
            problems.append(f"{item.path[0]}: expected a mapping, got {type(section).__name__}")
            continue
        section[item.path[1]] = item.value
        sources[item.path] = item.source
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems += _describe(exc, sources)
    if problems:
        raise ConfigError(problems)
    return config


def _read_file(path: str | Path, problems: list[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        problems.append(f"{path}: cannot read: {exc.strerror}")
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problems.append(f"{path}: not valid YAML: {exc}".replace("\n", " "))
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}: expected a mapping of sections, got {type(data).__name__}")
        return {}
    return data


def _env_overrides(env: Mapping[str, str], problems: list[str]) -> list[_Override]:
    found = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        section, sep, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if not sep or not _known_key(section, key):
            problems.append(
                f"{name}: unknown setting (expected {ENV_PREFIX}<SECTION>__<KEY>, "
                f"e.g. {ENV_PREFIX}SCHEDULER__CHUNK_SIZE)"
            )
            continue
        found.append(_Override((section, key), _parse_scalar(env[name]), f"env {name}"))
    return found


def _flag_overrides(flags: Iterable[str], problems: list[str]) -> list[_Override]:
    found = []
    for flag in flags:
        dotted, eq, raw = flag.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not eq or not dot or not _known_key(section, key):
            problems.append(f"--set {flag}: unknown setting (expected section.key=value)")
            continue
        found.append(_Override((section, key), _parse_scalar(raw), f"--set {dotted}"))
    return found


def _known_key(section: str, key: str) -> bool:
    model = SECTIONS.get(section)
    return model is not None and key in model.model_fields


def _parse_scalar(raw: str) -> Any:
    """Strings stay strings (pydantic coerces them); JSON lists and maps are parsed."""
    text = raw.strip()
    if text.startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return raw
    if text.lower() in ("null", "none", "~"):
        return None
    return raw


def _describe(exc: ValidationError, sources: Mapping[tuple[str, ...], str]) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        where = ".".join(loc) or "(top level)"
        origin = sources.get(loc[:2])
        suffix = f" (from {origin})" if origin else ""
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key{suffix}")
            continue
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"{where}{shown}: {err['msg']}{suffix}")
    return lines


def dump_yaml(config: Config) -> str:
    """The resolved configuration as YAML that ``load_config`` reads back unchanged."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
