"""The worker as a subprocess on a tiny random checkpoint, and the reference decode peer in
this process. Worker start-up helpers are shared with tests/integration/daemon."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefill_worker.testing.decode_peer import DecodePeer
from prefill_worker.testing.launch import ChildProcess
from tests.checkpoints import make_checkpoint
from tests.integration.daemon.conftest import (
    PAGE_SIZE,
    ROOT,
    Worker,
    free_port,
    start_worker,
    wait_ready,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("e2e-ckpt") / "llama")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Worker]:
    started = start_worker(tmp_path_factory.mktemp("e2e-worker"), checkpoint)
    try:
        wait_ready(started)
        yield started
    finally:
        started.child.kill()


@pytest.fixture
def decode_peer(worker: Worker, checkpoint: Path) -> Iterator[DecodePeer]:
    """fp32 like configs/tiny-test.yaml; no stop tokens, so every request decodes in full."""
    peer = DecodePeer.load(
        str(checkpoint),
        worker.bootstrap,
        dtype="float32",
        attention_backend="sdpa",
        page_size=PAGE_SIZE,
        num_pages=512,
        num_threads=1,
        stop_token_ids=(),
        max_batch_size=8,
    )
    yield peer
    peer.close()


def start_peer_process(
    bootstrap: str, checkpoint: Path, tmp_path: Path
) -> tuple[ChildProcess, str]:
    """The reference decode peer (`python -m prefill_worker.testing.decode_peer`) with the
    tiny-test layout, EOS ignored (as in process); returns the child and its control endpoint."""
    control = f"tcp://127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "prefill_worker.testing.decode_peer", "--model", str(checkpoint)]
    args += ["--bootstrap", bootstrap, "--bind", control, "--dtype", "float32"]
    args += ["--attention-backend", "sdpa", "--page-size", str(PAGE_SIZE), "--num-pages", "256"]
    args += ["--num-threads", "1", "--ignore-eos"]
    return ChildProcess.start("decode-peer", args, tmp_path, cwd=ROOT), control
