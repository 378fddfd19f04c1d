"""deploy/kubernetes/components: the autoscaling kit. Each component renders on top of an
overlay with kustomize; the HPA validates strictly with kubernetes-validate; the KEDA
ScaledObject (a CRD it has no schema for) is checked here: it scales the worker's StatefulSet,
and its query, like the Prometheus adapter's rule the HPA relies on, parses (promtool) and
reads only what the worker exports."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.promql_names import metric_names
from tests.unit.deploy.test_kubernetes import KUBECTL, KUBERNETES, Doc, by_kind
from tests.unit.deploy.test_monitoring import MONITORING, PROMTOOL, exported_names
from tests.unit.deploy.tools import need

BACKLOG = "prefill_worker_backlog_seconds"


def render_with(component: str, tmp_path: Path) -> list[Doc]:
    """The cpu-demo overlay with ``component`` added, as a user's overlay would add it."""
    tmp_path.mkdir(exist_ok=True)
    root = os.path.relpath(KUBERNETES, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [f"{root}/overlays/cpu-demo"],
                "components": [f"{root}/components/{component}"],
            }
        )
    )
    kubectl = need("kubectl", KUBECTL)
    proc = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def check_promql(expr: str, tmp_path: Path) -> None:
    promtool = need("promtool", PROMTOOL)
    rule = {
        "groups": [{"name": "autoscaling", "rules": [{"record": "q:autoscaling", "expr": expr}]}]
    }
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert metric_names(expr) <= exported_names(), expr


def test_the_hpa_validates_and_scales_the_statefulset_on_the_backlog(tmp_path: Path) -> None:
    kinds = by_kind(render_with("hpa", tmp_path))
    hpa = kinds["HorizontalPodAutoscaler"]
    path = tmp_path / "hpa.yaml"
    path.write_text(yaml.safe_dump(hpa))
    validate = need("kubernetes-validate", "in requirements.lock; make setup installs it")
    proc = subprocess.run(
        [validate, "--strict", "--quiet", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "WARN" not in proc.stdout + proc.stderr, proc.stdout
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (
        "StatefulSet",
        kinds["StatefulSet"]["metadata"]["name"],
    )
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == BACKLOG and BACKLOG in exported_names()
    assert float(metric["pods"]["target"]["averageValue"]) > 0


def test_the_adapter_rule_serves_the_metric_the_hpa_reads(tmp_path: Path) -> None:
    (rule,) = yaml.safe_load((MONITORING / "prometheus-adapter.yaml").read_text())["rules"][
        "custom"
    ]
    assert rule["name"]["as"] == BACKLOG
    assert rule["seriesQuery"].startswith(BACKLOG + "{")
    query = rule["metricsQuery"].replace("<<.Series>>", BACKLOG)
    query = query.replace("<<.LabelMatchers>>", 'pod="p"').replace("<<.GroupBy>>", "pod")
    check_promql(query, tmp_path)


def test_the_scaled_object_scales_the_statefulset_on_the_backlog(tmp_path: Path) -> None:
    kinds = by_kind(render_with("keda", tmp_path))
    scaled = kinds["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": kinds["StatefulSet"]["metadata"]["name"],
    }
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    meta = trigger["metadata"]
    assert set(meta) == {"serverAddress", "query", "threshold", "activationThreshold"}
    assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)
    assert metric_names(meta["query"]) == {BACKLOG}
    check_promql(meta["query"], tmp_path)
    # The statefulset's pods are what the query's pod pattern matches.
    assert 'pod=~"prefill-worker-[0-9]+"' in meta["query"]


@pytest.mark.parametrize("component", ["keda", "hpa"])
def test_a_component_only_adds_its_autoscaler(component: str, tmp_path: Path) -> None:
    plain = render_with_nothing(tmp_path / "plain")
    added = render_with(component, tmp_path / component)
    extra = [doc for doc in added if doc not in plain]
    assert [doc["kind"] for doc in extra] == [
        {"keda": "ScaledObject", "hpa": "HorizontalPodAutoscaler"}[component]
    ]


def render_with_nothing(path: Path) -> list[Doc]:
    path.mkdir()
    kubectl = need("kubectl", KUBECTL)
    overlay = KUBERNETES / "overlays" / "cpu-demo"
    proc = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
