"""deploy/monitoring: rule files check clean, the alert unit tests pass, and every dashboard
query parses and reads only names the worker exports or the recording rules record."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from prefill_worker.service.metrics import LATENCY_BUCKETS_S, WorkerMetrics
from tests.unit.deploy.promql_names import metric_names
from tests.unit.deploy.tools import DEPLOY, need

MONITORING = DEPLOY / "monitoring"
RULE_FILES = [MONITORING / "recording-rules.yaml", MONITORING / "alerts.yaml"]
DASHBOARD = MONITORING / "grafana" / "prefill-worker.json"
PROMTOOL = "Debian's prometheus package; make setup installs it"
# Grafana's variables, as a query would see them.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$job": ".*"}
GRAFANA_VARIABLES |= {"$instance": ".*"}
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
VLLM_TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


def exported_names() -> set[str]:
    """Every series name the worker's registry can expose."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
    suffixes |= {"info": ("_info",), "gauge": ("",)}
    names = set()
    for family in WorkerMetrics(CollectorRegistry()).registry.collect():
        names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names | {"up"}  # Prometheus' own, per target


def rules() -> list[dict]:
    return [
        rule
        for path in RULE_FILES
        for g in yaml.safe_load(path.read_text())["groups"]
        for rule in g["rules"]
    ]


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [
        t["expr"]
        for panel in board["panels"]
        for t in panel["targets"]
        if t["datasource"]["type"] == "prometheus"
    ]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


def grafana_to_promql(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query.replace('"$1"', ""), query
    return query


def test_rule_files_check_clean() -> None:
    promtool = need("promtool", PROMTOOL)
    proc = subprocess.run(
        [promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alert_unit_tests_pass() -> None:
    promtool = need("promtool", PROMTOOL)
    tests = MONITORING / "tests" / "rules-test.yaml"
    proc = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = yaml.safe_load(tests.read_text())["tests"]
    tested = {case["alertname"] for test in cases for case in test.get("alert_rule_test", [])}
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert len(alerts) >= 6 and alerts <= tested  # every alert has a case


def test_rules_read_only_exported_or_recorded_names() -> None:
    known = exported_names() | {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        assert metric_names(rule["expr"]) <= known, (rule, metric_names(rule["expr"]) - known)


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    promtool = need("promtool", PROMTOOL)
    queries = [q for q in dashboard_queries() if not q.startswith("label_values(")]
    assert len(queries) >= 20
    group = {
        "name": "dashboard",
        "rules": [
            {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(q)}
            for i, q in enumerate(queries)
        ],
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_reads_only_exported_or_recorded_names() -> None:
    known = exported_names() | {rule["record"] for rule in rules() if "record" in rule}
    for query in dashboard_queries():
        if query.startswith("label_values("):
            query = query.removeprefix("label_values(").rsplit(",", 1)[0]
        names = metric_names(grafana_to_promql(query))
        assert names and names <= known, (query, names - known)


def test_the_name_finder_finds_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, job) (rate(a_bucket{job=~"x|y", le!="1"}[5m])))'
        " / on (job) group_left (model) b:c:ratio offset 5m > bool 0.5 and d unless inf"
    )
    assert metric_names(expr) == {"a_bucket", "b:c:ratio", "d"}


@pytest.mark.parametrize(
    "name",
    [
        "vllm:time_to_first_token_seconds_bucket",
        "sglang:queue_time_seconds_bucket",
        "vllm:kv_cache_usage_perc",
    ],
)
def test_compat_names_are_recorded(name: str) -> None:
    assert name in {rule.get("record") for rule in rules()}


def test_ttft_buckets_are_vllms() -> None:
    # The same `le` values: vllm:time_to_first_token_seconds sums with vLLM's own series.
    assert LATENCY_BUCKETS_S == VLLM_TTFT_BUCKETS
