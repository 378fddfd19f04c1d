"""Configuration: load order, unknown keys, per-field problems, YAML round trip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefill_worker.service.config import ConfigError, dump_yaml, load_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def problems_of(**kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    return info.value.problems


def test_defaults_without_a_file() -> None:
    config = load_config(None, env={})
    assert config.cache.page_size == 16
    assert config.scheduler.chunk_size == 512


def test_load_order_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduler:\n  chunk_size: 64\n  max_batch_tokens: 100\n")
    env = {"PREFILL_WORKER_SCHEDULER__CHUNK_SIZE": "128", "PREFILL_WORKER_CACHE__PAGE_SIZE": "8"}
    config = load_config(path, env=env, overrides=["cache.page_size=32"])
    assert config.scheduler.chunk_size == 128  # env beats file
    assert config.scheduler.max_batch_tokens == 100  # file kept
    assert config.cache.page_size == 32  # flag beats env


def test_every_problem_is_named_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model:\n  pth: x\ncache:\n  page_size: -4\nscheduler:\n  overlap: maybe\nbogus: 1\n",
    )
    env = {"PREFILL_WORKER_SCHEDULER__CHUNK_SIZE": "abc", "PREFILL_WORKER_NOPE__X": "1"}
    lines = problems_of(path=path, env=env)
    joined = "\n".join(lines)
    assert len(lines) == 6, joined
    assert "model.pth: unknown key" in joined
    assert "cache.page_size = -4: Input should be greater than or equal to 1" in joined
    assert "scheduler.overlap = 'maybe'" in joined
    assert "bogus: unknown key" in joined
    assert "PREFILL_WORKER_NOPE__X: unknown setting" in joined
    assert any(
        line.startswith("scheduler.chunk_size = 'abc'")
        and "valid integer" in line
        and "PREFILL_WORKER_SCHEDULER__CHUNK_SIZE" in line
        for line in lines
    )


def test_wrong_type_in_file(tmp_path: Path) -> None:
    lines = problems_of(path=write(tmp_path, "scheduler:\n  chunk_size: [1, 2]\n"), env={})
    assert lines == ["scheduler.chunk_size = [1, 2]: Input should be a valid integer"]


def test_unknown_flag_and_missing_file(tmp_path: Path) -> None:
    lines = problems_of(path=tmp_path / "absent.yaml", env={}, overrides=["cache.nope=1", "x"])
    assert any("cannot read" in line for line in lines)
    assert sum("unknown setting" in line for line in lines) == 2


def test_not_a_mapping(tmp_path: Path) -> None:
    assert "expected a mapping" in problems_of(path=write(tmp_path, "- 1\n"), env={})[0]


def test_cache_needs_a_size() -> None:
    lines = problems_of(path=None, env={}, overrides=["cache.num_pages=null"])
    assert "num_pages, memory_bytes or memory_fraction" in lines[0]


def test_env_list_value() -> None:
    env = {"PREFILL_WORKER_TRANSFER__NIXL_BACKENDS": '["UCX", "POSIX"]'}
    assert load_config(None, env=env).transfer.nixl_backends == ["UCX", "POSIX"]


def test_yaml_round_trip(tmp_path: Path) -> None:
    config = load_config(
        ROOT / "configs" / "default.yaml", env={}, overrides=["model.num_threads=2"]
    )
    text = dump_yaml(config)
    again = load_config(write(tmp_path, text), env={})
    assert again == config
    assert dump_yaml(again) == text


def test_config_is_frozen() -> None:
    config = load_config(None, env={})
    with pytest.raises(ValueError):
        config.cache.page_size = 1  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_its_first_line_says_what_makes_its_model(
    path: Path,
) -> None:
    config = load_config(path, env={})
    first_line = path.read_text().splitlines()[0]
    if Path(config.model.path).is_absolute():
        # A real target (docs/deploy.md): the model is fetched onto the host, and the first
        # line names it and the accelerator; tests/unit/deploy/test_configs.py checks it
        # against the model's own config.json.
        assert first_line.startswith("#") and "Hugging Face" in first_line, first_line
        return
    assert first_line.startswith("#") and "make setup" in first_line, first_line
    if os.environ.get("CI") == "true":  # CI ran `make setup`: the model must be there
        assert (ROOT / config.model.path / "config.json").exists(), config.model.path
