"""deploy/systemd/prefill-worker@.service: `systemd-analyze verify` is clean for an instance,
the instance's ports and GPU come out of its ExecStart as the header says (run through sh
against the real CLI's print-config), a non-numeric instance is a config error, and the
timeouts leave room for the drain and the liveness rule."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefill_worker.service.config import load_config
from tests.unit.deploy.tools import DEPLOY, ROOT, need

TEMPLATE = DEPLOY / "systemd" / "prefill-worker@.service"
INSTALLED_EXE = "/opt/prefill-worker/.venv/bin/prefill-worker"
CONFIG = ROOT / "configs" / "llama-3.1-8b-h200.yaml"


def settings() -> dict[str, list[str]]:
    """Each key's values, continuation lines joined as systemd joins them."""
    text = TEMPLATE.read_text().replace("\\\n", " ")
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def one(key: str) -> str:
    (value,) = settings()[key]
    return value


def exec_start(instance: str, exe: str, command: str) -> list[str]:
    """ExecStart for ``instance`` with systemd's specifiers and `$$` expanded, as argv."""
    argv = shlex.split(one("ExecStart"))
    script = argv[2].replace("%i", instance).replace("%H", socket.gethostname())
    script = script.replace("$$", "$").replace(INSTALLED_EXE, exe)
    script = script.replace(" serve /etc/prefill-worker/config.yaml", f" {command} {CONFIG}")
    return [*argv[:2], script]


def test_an_instance_verifies_without_warnings(tmp_path: Path) -> None:
    analyze = need("systemd-analyze", "part of systemd")
    exe = Path(sys.executable).parent / "prefill-worker"
    assert exe.exists()
    unit = tmp_path / "prefill-worker@0.service"
    unit.write_text(TEMPLATE.read_text().replace(INSTALLED_EXE, str(exe)))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_the_instance_picks_the_gpu_and_the_ports(tmp_path: Path) -> None:
    assert "CUDA_VISIBLE_DEVICES=%i" in settings()["Environment"]
    exe = f"{shlex.quote(sys.executable)} -m prefill_worker"
    proc = subprocess.run(
        exec_start("3", exe, "print-config"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "CREDENTIALS_DIRECTORY": "/run/credentials/x"},
    )
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert config["ingress"]["bind"] == "tcp://0.0.0.0:5587"
    assert config["transfer"]["bootstrap_bind"] == "tcp://0.0.0.0:5588"
    assert config["metrics"]["bind"] == "0.0.0.0:9403"
    assert config["transfer"]["agent_name"] == f"{socket.gethostname()}-gpu3"
    assert config["metrics"]["admin_token_file"] == "/run/credentials/x/admin-token"


@pytest.mark.parametrize("instance", ["gpu0", ""])
def test_an_instance_that_is_not_a_gpu_index_is_a_config_error(instance: str) -> None:
    proc = subprocess.run(exec_start(instance, "false", "serve"), capture_output=True, text=True)
    assert proc.returncode == 78 and "must be a GPU index" in proc.stderr


def test_notify_watchdog_and_room_to_drain() -> None:
    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    assert one("KillSignal") == "SIGTERM" and "78" in one("RestartPreventExitStatus")
    config = load_config(CONFIG, env={})
    assert int(one("TimeoutStopSec")) > config.daemon.drain_timeout_s
    assert int(one("WatchdogSec")) > config.metrics.livez_stale_s
    assert one("LimitMEMLOCK") == "infinity"  # RDMA registration pins the KV pool
