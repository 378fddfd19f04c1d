"""A real scrape: `promtool check metrics` is clean on the live endpoint, and a real Prometheus
server scraping the worker on 127.0.0.1 reports the number of requests sent."""

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

from prefill_worker.request import OutcomeStatus
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Decode, free_port, wait_until

NUM_REQUESTS = 3
REQUESTS_TOTAL = "prefill_worker_requests_total{"


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
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
    except OSError:
        return None
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def num_requests_total(metrics_text: str) -> float:
    """The sum over the labels of ``prefill_worker_requests_total``, as the text has it."""
    lines = metrics_text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(REQUESTS_TOTAL))


def test_real_prometheus_scrapes_the_worker(shared_worker, router_factory, tmp_path: Path) -> None:
    promtool, prometheus = need("promtool"), need("prometheus")
    worker = shared_worker
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    prompts = {room: prompt(6 + room, seed=room) for room in range(1, NUM_REQUESTS + 1)}
    for room, ids in prompts.items():
        decode.want(room, len(ids))
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(router.prefill, ids, room) for room, ids in prompts.items()]
        decode.wait(list(prompts))
        assert all(f.result(timeout=60).status is OutcomeStatus.OK for f in futures)

    status, text = worker.http("/metrics")
    assert status == 200
    num_requests = num_requests_total(text)  # the shared worker served other tests' too
    assert num_requests >= NUM_REQUESTS
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stderr

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
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
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        decode.close()
