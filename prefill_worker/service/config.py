"""Loading the worker's configuration: the one place that reads files and env.

Load order (later wins): the YAML file, then ``PREFILL_WORKER_<SECTION>__<KEY>`` environment
variables, then ``--set section.key=value`` flags from the CLI. Unknown keys anywhere are errors
that name the key. Every problem is collected and reported at once, one line each, as a
``ConfigError`` whose ``problems`` the CLI prints before exiting with ``EX_CONFIG`` (78). The
models themselves live in ``schema.py`` (the sections in ``sections/``); they are re-exported
here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from prefill_worker.service.schema import (
    SECTIONS,
    CacheConfig,
    Config,
    DaemonConfig,
    IngressConfig,
    MetricsConfig,
    ModelConfig,
    SchedulerConfig,
    TransferConfig,
)

ENV_PREFIX = "PREFILL_WORKER_"
EX_CONFIG = 78


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


__all__ = [
    "ENV_PREFIX",
    "EX_CONFIG",
    "SECTIONS",
    "CacheConfig",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "IngressConfig",
    "MetricsConfig",
    "ModelConfig",
    "SchedulerConfig",
    "TransferConfig",
    "dump_yaml",
    "load_config",
]
