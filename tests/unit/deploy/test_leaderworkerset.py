"""deploy/kubernetes/components/leaderworkerset: a tensor-parallel group across hosts as a
LeaderWorkerSet. Rendered over the cpu-demo overlay with kustomize; the LeaderWorkerSet (a CRD
kubernetes-validate has no schema for) has each of its pod templates validated strictly as a
Pod, and the rest checked here: torchrun in every pod with the controller's group size, worker
index and leader address; the worker's configuration (the ConfigMap and the pod's env) valid
with the group's size, its interface and its secret file, mounted from the group's Secret; the
generated names and the image reach into the templates; the Service, the PodDisruptionBudget
and the PodMonitor select the leaders only; no StatefulSet left."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from prefill_worker.service.config import load_config
from prefill_worker.tp.group import Placement
from tests.unit.deploy.test_kubernetes import KUBECTL, KUBERNETES, Doc, by_kind
from tests.unit.deploy.tools import need

LEADER = "leaderworkerset.sigs.k8s.io/worker-index"
IMAGE = "registry.example.com/prefill-worker:0.1.0"


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> list[Doc]:
    where = tmp_path_factory.mktemp("lws")
    root = os.path.relpath(KUBERNETES, where)
    kustomization = {
        "resources": [f"{root}/overlays/cpu-demo"],
        "components": [f"{root}/components/leaderworkerset"],
        "images": [{"name": "prefill-worker", "newName": IMAGE.split(":")[0], "newTag": "0.1.0"}],
    }
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    kubectl = need("kubectl", KUBECTL)
    proc = subprocess.run([kubectl, "kustomize", str(where)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def templates(docs: list[Doc]) -> dict[str, Doc]:
    group = by_kind(docs)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


def test_each_pod_template_validates_strictly_as_a_pod(docs: list[Doc], tmp_path: Path) -> None:
    assert "StatefulSet" not in by_kind(docs)
    pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"lws-{role}", **t["metadata"]},
         "spec": t["spec"]}
        for role, t in templates(docs).items()
    ]  # fmt: skip
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all(pods))
    validate = need("kubernetes-validate", "in requirements.lock; make setup installs it")
    proc = subprocess.run(
        [validate, "--strict", "--quiet", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "WARN" not in proc.stdout + proc.stderr, proc.stdout


def test_every_pod_is_one_torchrun_rank_of_the_group(docs: list[Doc], tmp_path: Path) -> None:
    lws = by_kind(docs)["LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    config_map = by_kind(docs)["ConfigMap"]
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    for role, template in templates(docs).items():
        spec = template["spec"]
        (container,) = spec["containers"]
        assert container["image"] == IMAGE and spec["initContainers"][0]["image"] == IMAGE
        command = container["command"]
        assert command[0] == "torchrun" and command[-2:] == ["-m", "prefill_worker"]
        ranks = ("--nnodes=$(LWS_GROUP_SIZE)", "--node-rank=$(LWS_WORKER_INDEX)")
        rendezvous = ("--master-addr=$(LWS_LEADER_ADDRESS)", "--nproc-per-node=1")
        assert {*ranks, *rendezvous} <= set(command)
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        config = load_config(tmp_path / "config.yaml", env=env)
        assert config.parallel.tp_size == size, role
        assert config.parallel.interface and config.parallel.group_secret_file
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert config.parallel.group_secret_file == f"{mounts['group']}/secret"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["group"]["secret"]["secretName"] == "prefill-worker-group"
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
        secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
        assert volumes["admin"]["secret"]["secretName"] in secrets  # the generated name
        # What each rank's process decides from torchrun's environment: across hosts, on
        # the configured interface (no ValueError: the interface is named).
        torchrun = {"RANK": "1", "WORLD_SIZE": str(size), "MASTER_ADDR": "10.0.0.7"}
        placement = Placement.from_environ(torchrun, size, config.parallel.interface)
        assert placement is not None and placement.spans_hosts
    leader, worker = (templates(docs)[r]["spec"]["containers"][0] for r in ("leader", "worker"))
    assert "readinessProbe" in leader and "readinessProbe" not in worker  # ranks serve no HTTP
    assert leader["lifecycle"]["preStop"]["exec"]["command"][:2] == ["prefill-worker", "drain"]


def test_routers_and_monitoring_see_the_leaders_only(docs: list[Doc]) -> None:
    kinds = by_kind(docs)
    labels = templates(docs)["leader"]["metadata"]["labels"]
    selectors = [
        kinds["Service"]["spec"]["selector"],
        kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        kinds["PodMonitor"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector[LEADER] == "0"  # the controller's label of each group's leader pod
        rest = {k: v for k, v in selector.items() if k != LEADER}
        assert rest and rest.items() <= labels.items(), selector
