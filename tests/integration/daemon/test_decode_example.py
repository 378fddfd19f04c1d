"""docs/protocol.md's "Write a decode integration" walkthrough runs as written: the example
(``examples/decode_integration.py``) against a real worker, once per pool layout (the blocking
``wait`` against the tiny config as it is, ``await wait_async`` against a page-major worker),
and against an MLA model's worker (one latent per layer) once ``MLA_FAMILIES`` names one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.checkpoints import make_checkpoint
from tests.integration.daemon.conftest import ROOT, Worker, start_worker, wait_ready

EXAMPLE = ROOT / "examples" / "decode_integration.py"
MLA_FAMILIES = ["deepseek_v3"]


def run_example(worker: Worker, *flags: str) -> str:
    args = [sys.executable, str(EXAMPLE), "--bootstrap", worker.bootstrap]
    args += ["--ingress", worker.ingress, "--prompts", "3", *flags]
    env = {"PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{worker.log()}"
    return proc.stdout


def test_the_walkthrough_example_receives_kv_and_first_tokens(shared_worker) -> None:
    out = run_example(shared_worker)
    assert "worker pool: layer_major, 2 layers, page size 4" in out
    assert out.count(": done first_token=") == 3


def test_the_example_against_a_page_major_worker_with_asyncio(worker_factory) -> None:
    worker = worker_factory("cache.layout=page_major")
    out = run_example(worker, "--asyncio")
    assert "worker pool: page_major, 2 layers, page size 4" in out
    assert out.count(": done first_token=") == 3


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_the_example_against_an_mla_worker(tmp_path, family: str) -> None:
    worker = start_worker(tmp_path, make_checkpoint(family, tmp_path / family))
    try:
        wait_ready(worker)
        out = run_example(worker)
        assert "worker pool: mla, " in out
        assert out.count(": done first_token=") == 3
    finally:
        worker.child.kill()
