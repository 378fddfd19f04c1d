"""A real scrape: `promtool check metrics` is clean on the live endpoint; the bytes counted are
the bytes each request's pages and aux row hold; a real Prometheus server scraping the worker on
127.0.0.1, with deploy/monitoring's recording rules, reports the number of requests sent and
the same counts under vLLM's and SGLang's names."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.request import OutcomeStatus
from prefill_worker.service.metrics import LATENCY_BUCKETS_S
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    PAGE_SIZE,
    ROOT,
    Decode,
    free_port,
    wait_until,
)
from tests.patience import patient

NUM_REQUESTS = 3
REQUESTS_TOTAL = "prefill_worker_requests_total{"
RECORDING_RULES = ROOT / "deploy" / "monitoring" / "recording-rules.yaml"
# K and V of every layer, fp32 (configs/tiny-test.yaml), per page
PAGE_BYTES = 2 * NUM_LAYERS * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 4


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{tool} is not installed (make setup installs Debian's prometheus)")
        pytest.skip(f"{tool} is not installed")
    return path


def query(port: int, expr: str) -> float | None:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=patient(5)) as response:
            body = json.load(response)
    except OSError:
        return None
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def num_requests_total(metrics_text: str) -> float:
    """The sum over the labels of ``prefill_worker_requests_total``, as the text has it."""
    lines = metrics_text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(REQUESTS_TOTAL))


def transfer_bytes(metrics_text: str) -> float:
    name = "prefill_worker_transfer_bytes_total "
    return next(
        float(line.split()[-1]) for line in metrics_text.splitlines() if line.startswith(name)
    )


def test_real_prometheus_scrapes_the_worker(
    shared_worker, router_factory, tmp_path: Path, checkpoint: Path
) -> None:
    promtool, prometheus = need("promtool"), need("prometheus")
    worker = shared_worker
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    prompts = {room: prompt(6 + room, seed=room) for room in range(1, NUM_REQUESTS + 1)}
    bytes_before = transfer_bytes(worker.http("/metrics")[1])
    for room, ids in prompts.items():
        decode.want(room, len(ids))
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(router.prefill, ids, room) for room, ids in prompts.items()]
        decode.wait(list(prompts))
        assert all(f.result(timeout=patient(60)).status is OutcomeStatus.OK for f in futures)

    status, text = worker.http("/metrics")
    assert status == 200
    num_requests = num_requests_total(text)  # the shared worker served other tests' too
    assert num_requests >= NUM_REQUESTS
    # What landed: each prompt's pages (K and V of each layer) and its aux row.
    expected = sum(
        -(-len(ids) // PAGE_SIZE) * PAGE_BYTES + AUX_ROW_BYTES for ids in prompts.values()
    )
    assert transfer_bytes(text) - bytes_before == expected
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stderr

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RECORDING_RULES}']\n"
        "scrape_configs:\n"
        "  - job_name: prefill-worker\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{worker.http_port}']}}]\n"
    )
    server = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        expr = "sum(prefill_worker_requests_total)"
        wait_until(lambda: query(port, expr) == num_requests, 60, "prometheus to scrape")
        assert query(port, 'up{job="prefill-worker"}') == 1
        ttft = "sum(prefill_worker_time_to_first_token_seconds_count)"
        wait_until(
            lambda: (
                query(port, "sum(vllm:time_to_first_token_seconds_count)") == query(port, ttft)
                and query(port, "sum(sglang:time_to_first_token_seconds_count)")
                == query(port, ttft)
            ),
            60,
            "the recording rules to see the scrape",
        )
        model = f'model_name="{checkpoint}"'
        buckets = f"count(vllm:time_to_first_token_seconds_bucket{{{model}}})"
        assert query(port, buckets) == len(LATENCY_BUCKETS_S) + 1  # and +Inf
        assert query(port, "sum(sglang:token_usage >= 0)") is not None
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        decode.close()
