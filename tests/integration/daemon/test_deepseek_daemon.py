"""The daemon on a tiny DeepSeek-V3 checkpoint, in process: it loads the MLA family, allocates
an ``mla`` pool (one latent row of ``kv_lora_rank + qk_rope_head_dim`` per token and layer,
no V), warms up through the MLA forward, registers the pool for transfer, serves /readyz with
the layout a decode sizes its pool by, and drains to exit 0. ``check-config`` reads it.
(Requests end to end need a decode that registers an MLA pool: the transfer side's work.)
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from pathlib import Path

from prefill_worker.service.checkmodel import check_model
from prefill_worker.service.config import load_config
from prefill_worker.service.daemon import Daemon
from tests.checkpoints import make_checkpoint, with_mtp_layer
from tests.integration.daemon.conftest import ROOT, free_port, wait_until
from tests.patience import patient


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=patient(5)) as response:
        return response.read().decode()


def test_the_daemon_serves_a_deepseek_v3_checkpoint(tmp_path: Path) -> None:
    checkpoint = make_checkpoint("deepseek_v3", tmp_path / "dsv3")
    http_port = free_port()
    config = load_config(
        ROOT / "configs" / "tiny-test.yaml",
        env={},
        overrides=[f"model.path={checkpoint}", f"metrics.bind=127.0.0.1:{http_port}"],
    )
    assert any("DeepseekV3ForCausalLM" in note for note in check_model(config).notes)
    daemon = Daemon(config, env={})
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        wait_until(lambda: daemon.health.is_ready, 120, "ready")
        layout = json.loads(http_get(http_port, "/readyz"))["kv_layout"]
        assert (layout["kind"], layout["num_kv_heads"], layout["head_dim"]) == ("mla", 1, 32 + 8)
        warm_up = re.search(
            r"^prefill_worker_warmup_seconds (\S+)$", http_get(http_port, "/metrics"), re.M
        )
        assert warm_up and float(warm_up.group(1)) > 0
    finally:
        daemon.request_drain()
        thread.join(timeout=patient(120))
    assert codes == [0]


def test_the_daemon_warms_up_through_the_mtp_draft(tmp_path: Path) -> None:
    """``model.draft: mtp`` on a checkpoint with an MTP layer: the warm-up's chunks run the
    draft (each names its next token), and the draft's time is a metric."""
    checkpoint = with_mtp_layer(tmp_path)
    http_port = free_port()
    config = load_config(
        ROOT / "configs" / "tiny-test.yaml",
        env={},
        overrides=[
            f"model.path={checkpoint}",
            f"metrics.bind=127.0.0.1:{http_port}",
            "model.draft=mtp",
            "model.draft_topk=2",
        ],
    )
    daemon = Daemon(config, env={})
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        wait_until(lambda: daemon.health.is_ready, 120, "ready")
        text = http_get(http_port, "/metrics")
        count = re.search(r"^prefill_worker_draft_forward_seconds_count (\S+)$", text, re.M)
        assert count and float(count.group(1)) >= 2  # the warm-up's chunks, each
    finally:
        daemon.request_drain()
        thread.join(timeout=patient(120))
    assert codes == [0]
