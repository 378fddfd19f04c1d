"""deploy/: the systemd unit verifies cleanly, the Kubernetes manifests validate, and the
configuration they ship is one the worker accepts, with drain fitting in the stop timeouts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefill_worker.service.config import load_config

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
UNIT = DEPLOY / "systemd" / "prefill-worker.service"
MANIFEST = DEPLOY / "kubernetes" / "prefill-worker.yaml"
VENV_BIN = Path(sys.executable).parent


def unit_settings() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in UNIT.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if not k.startswith("#")}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_unit_verifies_without_warnings(tmp_path: Path) -> None:
    exe = VENV_BIN / "prefill-worker"
    assert exe.exists()
    text = UNIT.read_text().replace("/opt/prefill-worker/.venv/bin/prefill-worker", str(exe))
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_systemd_unit_is_notify_with_watchdog_and_drain_room() -> None:
    settings = unit_settings()
    assert settings["Type"] == "notify"
    assert settings["KillSignal"] == "SIGTERM"
    assert "78" in settings["RestartPreventExitStatus"]
    assert int(settings["WatchdogSec"]) > 0
    assert int(settings["TimeoutStopSec"]) > load_config(None, env={}).daemon.drain_timeout_s


def manifests() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def test_kubernetes_manifests_validate(tmp_path: Path) -> None:
    core = [doc for doc in manifests() if doc["kind"] != "PodMonitor"]
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    proc = subprocess.run(
        [str(VENV_BIN / "kubernetes-validate"), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "WARN" not in proc.stdout + proc.stderr, proc.stdout
    assert {doc["kind"] for doc in core} >= {"ConfigMap", "StatefulSet", "Service"}


def test_pod_monitor_scrapes_the_metrics_port() -> None:
    # kubernetes-validate has no schema for this CRD, so check its few fields here.
    monitor = next(doc for doc in manifests() if doc["kind"] == "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}


def test_shipped_config_is_valid_and_probes_match(tmp_path: Path) -> None:
    docs = {doc["kind"]: doc for doc in manifests()}
    path = tmp_path / "config.yaml"
    path.write_text(docs["ConfigMap"]["data"]["config.yaml"])
    config = load_config(path, env={})
    pod = docs["StatefulSet"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.daemon.drain_timeout_s
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.ingress.bind.endswith(f":{ports['ingress']}")
    assert config.transfer.bootstrap_bind.endswith(f":{ports['bootstrap']}")
    assert config.metrics.bind.endswith(f":{ports['metrics']}")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
