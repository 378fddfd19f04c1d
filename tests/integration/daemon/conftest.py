"""The worker as a subprocess on the tiny test config, a decode peer (a real ``KVReceiver``
over real NIXL) in this process, and a router (``BlockingRouterClient``) over real ZMQ."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from prefill_worker.client import BlockingRouterClient
from prefill_worker.transfer.receiver import KVReceiver, RoomState, RoomStatus
from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]
PAGE_SIZE = 4  # configs/tiny-test.yaml
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16  # tests/checkpoints.py COMMON (llama)
DECODE_PAGES = 256


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("daemon-ckpt") / "llama")


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    ingress: str
    bootstrap: str
    http_port: int
    notify: socket.socket
    log_path: Path
    notifications: list[str] = field(default_factory=list)

    def http(self, path: str, method: str = "GET") -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def collect_notifications(self) -> None:
        """Read sd_notify datagrams as they come (the kernel queues only ~10), until closed."""
        self.notify.settimeout(0.2)
        while self.notify.fileno() != -1:
            try:
                self.notifications.append(self.notify.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"worker did not exit in {timeout_s} s\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def start_worker(
    tmp_path: Path, checkpoint: Path, *settings: str, env: dict[str, str] | None = None
) -> Worker:
    ingress = f"tcp://127.0.0.1:{free_port()}"
    bootstrap = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    notify_path = str(tmp_path / f"notify-{http_port}.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    flags = [
        f"model.path={checkpoint}",
        f"ingress.bind={ingress}",
        f"transfer.bootstrap_bind={bootstrap}",
        f"metrics.bind=127.0.0.1:{http_port}",
        *settings,
    ]
    args = [sys.executable, "-m", "prefill_worker", "serve", "configs/tiny-test.yaml"]
    for flag in flags:
        args += ["--set", flag]
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFILL_WORKER_")}
    log_path = tmp_path / f"worker-{http_port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**base, "NOTIFY_SOCKET": notify_path, "NIXL_LOG_LEVEL": "WARN", **(env or {})},
        )
    worker = Worker(proc, ingress, bootstrap, http_port, notify, log_path)
    threading.Thread(target=worker.collect_notifications, daemon=True).start()
    return worker


def wait_ready(worker: Worker, timeout_s: float = 120.0) -> None:
    def is_ready() -> bool:
        assert worker.proc.poll() is None, f"worker exited early:\n{worker.log()}"
        return any(n.startswith("READY=1") for n in worker.notifications)

    wait_until(is_ready, timeout_s, "READY=1")


@pytest.fixture
def worker_factory(tmp_path: Path, checkpoint: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def factory(*settings: str, env: dict[str, str] | None = None, ready: bool = True) -> Worker:
        worker = start_worker(tmp_path, checkpoint, *settings, env=env)
        started.append(worker)
        if ready:
            wait_ready(worker)
        return worker

    yield factory
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGKILL)
            worker.proc.wait()
        worker.notify.close()


class Decode:
    """A decode peer: its own KV pool (zeros), a KVReceiver, and a page allocator."""

    def __init__(self, bootstrap: str, peer_timeout_s: float = 10.0) -> None:
        shape = (DECODE_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        self.v = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=64, peer_timeout_s=peer_timeout_s
        )
        self.receiver.wait_registered(timeout_s=30)
        self._next_page = DECODE_PAGES - 1  # hand out descending pages: order bugs show
        self._next_slot = 0
        self.rooms: dict[int, tuple[list[int], int]] = {}

    def want(self, room: int, num_tokens: int) -> None:
        count = -(-num_tokens // PAGE_SIZE)
        pages = [self._next_page - 2 * i for i in range(count)]  # scattered
        self._next_page -= 2 * count
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.rooms[room] = (pages, slot)
        self.receiver.want(room, pages, slot, 0)

    def wait(self, rooms: Sequence[int], timeout_s: float = 60.0) -> dict[int, RoomStatus]:
        def settled() -> bool:
            self.receiver.progress()
            return all(self.receiver.poll(r).state is not RoomState.PENDING for r in rooms)

        wait_until(settled, timeout_s, f"rooms {list(rooms)}")
        return {room: self.receiver.poll(room) for room in rooms}

    def kv(self, room: int, num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the room's prompt as landed here: ``[num_tokens, KV, D]`` each."""
        pages, _ = self.rooms[room]
        k = torch.cat([self.k[layer][p] for p in pages])[:num_tokens]
        v = torch.cat([self.v[layer][p] for p in pages])[:num_tokens]
        return k, v

    def close(self) -> None:
        self.receiver.close()


@pytest.fixture
def router_factory() -> Iterator[Callable[[str], BlockingRouterClient]]:
    clients: list[BlockingRouterClient] = []

    def factory(endpoint: str) -> BlockingRouterClient:
        clients.append(BlockingRouterClient(endpoint))
        return clients[-1]

    yield factory
    for client in clients:
        client.close()
