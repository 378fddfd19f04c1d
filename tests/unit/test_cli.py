"""The CLI as a user runs it: exit codes, messages, round trip, version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prefill_worker import __version__

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFILL_WORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "prefill_worker", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, **(env or {})},
    )


def test_check_config_ok() -> None:
    proc = cli("check-config", "configs/default.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "cache.layout layer_major: serves native decodes of the same layout, SGLang" in (
        proc.stdout
    )


def test_check_config_says_what_a_vllm_blocks_pool_serves() -> None:
    flags = ["--set", "cache.layout=vllm_blocks", "--set", "cache.page_size=32"]
    proc = cli("check-config", "configs/default.yaml", *flags)
    assert proc.returncode == 0, proc.stderr
    assert "vLLM pull and push straight from the pool" in proc.stdout
    assert "not SGLang decodes" in proc.stdout


def test_check_config_bad_exits_78_naming_each_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  page_sise: 16\n  num_pages: -1\nscheduler:\n  chunk_size: big\n")
    proc = cli("check-config", str(bad))
    assert proc.returncode == 78
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3, proc.stderr
    assert any("cache.page_sise: unknown key" in line for line in lines)
    assert any("cache.num_pages = -1" in line for line in lines)
    assert any("scheduler.chunk_size = 'big'" in line for line in lines)


def test_env_var_refused_with_clear_message() -> None:
    proc = cli(
        "check-config", "configs/default.yaml", env={"PREFILL_WORKER_SCHEDULER__CHUNK_SIZE": "abc"}
    )
    assert proc.returncode == 78
    assert "scheduler.chunk_size = 'abc'" in proc.stderr
    assert "PREFILL_WORKER_SCHEDULER__CHUNK_SIZE" in proc.stderr


def test_print_config_round_trips(tmp_path: Path) -> None:
    first = cli("print-config", "--config", "configs/default.yaml", "--log-format", "json")
    assert first.returncode == 0, first.stderr
    assert "log_format: json" in first.stdout
    path = tmp_path / "resolved.yaml"
    path.write_text(first.stdout)
    second = cli("print-config", "--config", str(path))
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def test_version() -> None:
    proc = cli("version")
    assert proc.returncode == 0 and proc.stdout.strip() == __version__
