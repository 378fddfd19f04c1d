"""The worker as a subprocess on a tiny random checkpoint, and the reference decode peer in
this process. Worker start-up helpers are shared with tests/integration/daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefill_worker.decode_peer import DecodePeer
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
        if started.proc.poll() is None:
            started.proc.send_signal(signal.SIGKILL)
            started.proc.wait()
        started.notify.close()


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


@dataclass
class PeerProcess:
    popen: subprocess.Popen[bytes]
    control: str
    notify: socket.socket
    log_path: Path

    def is_ready(self) -> bool:
        assert self.popen.poll() is None, f"decode peer exited early:\n{self.log()}"
        try:
            return self.notify.recv(4096).startswith(b"READY=1")
        except BlockingIOError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_peer_process(bootstrap: str, checkpoint: Path, tmp_path: Path) -> PeerProcess:
    """`prefill-worker decode-peer` with the tiny-test layout, EOS ignored (as in process)."""
    control = f"tcp://127.0.0.1:{free_port()}"
    notify_path = tmp_path / "peer.notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.setblocking(False)
    args = [sys.executable, "-m", "prefill_worker", "decode-peer", "--model", str(checkpoint)]
    args += ["--bootstrap", bootstrap, "--bind", control, "--dtype", "float32"]
    args += ["--attention-backend", "sdpa", "--page-size", str(PAGE_SIZE), "--num-pages", "256"]
    args += ["--num-threads", "1", "--ignore-eos"]
    log_path = tmp_path / "peer.log"
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "NIXL_LOG_LEVEL": "WARN"}
    with log_path.open("wb") as log:
        popen = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    return PeerProcess(popen, control, notify, log_path)
