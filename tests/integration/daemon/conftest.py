"""The worker as a subprocess on the tiny test config, a decode peer (a real ``KVReceiver``
over real NIXL) in this process, and a router (``BlockingRouterClient``) over real ZMQ.

``shared_worker`` is one worker for every test here that only sends requests and reads
endpoints; ``worker_factory`` starts one per test, for the tests that stop, kill or configure it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import Outcome
from prefill_worker.testing.launch import ChildProcess, free_port
from prefill_worker.transfer import KVReceiver, RoomState, RoomStatus, describe_worker
from tests.checkpoints import make_checkpoint
from tests.patience import patient
from tests.polling import wait_until

__all__ = ["free_port", "wait_until"]  # re-exported for the daemon and e2e tests

ROOT = Path(__file__).resolve().parents[3]
PAGE_SIZE = 4  # configs/tiny-test.yaml
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16  # tests/checkpoints.py COMMON (llama)
DECODE_PAGES = 256


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("daemon-ckpt") / "llama")


@dataclass
class Worker:
    """`prefill-worker serve` as a child process, with the endpoints it was told to bind."""

    child: ChildProcess
    ingress: str
    bootstrap: str
    http_port: int
    ready_file: Path | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.child.popen

    @property
    def notifications(self) -> list[str]:
        return self.child.notifications

    def http(self, path: str, method: str = "GET") -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=patient(5)) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def wait_exit(self, timeout_s: float) -> int:
        timeout_s = patient(timeout_s)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"worker did not exit in {timeout_s} s\n{self.log()}") from None

    def log(self) -> str:
        return self.child.log_tail()


def start_worker(
    tmp_path: Path,
    checkpoint: Path,
    *settings: str,
    env: dict[str, str] | None = None,
    module: str = "prefill_worker",
    module_args: Sequence[str] = (),
) -> Worker:
    """``module``: ``prefill_worker.testing.spare`` starts a warm spare (it serves once sent
    SIGUSR1); ``prefill_worker.testing.tp_ranks`` takes its own ``module_args``."""
    ingress = f"tcp://127.0.0.1:{free_port()}"
    bootstrap = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    flags = [
        f"model.path={checkpoint}",
        f"ingress.bind={ingress}",
        f"transfer.bootstrap_bind={bootstrap}",
        f"metrics.bind=127.0.0.1:{http_port}",
        # a TP group's ranks import torch before they meet: on a busy machine that outlasts
        # the default's 60 s (a test that means a timeout sets its own, later, and wins)
        f"parallel.rendezvous_timeout_s={patient(60):g}",
        *settings,
    ]
    args = [sys.executable, "-m", module, *module_args, "serve", "configs/tiny-test.yaml"]
    for flag in flags:
        args += ["--set", flag]
    child = ChildProcess.start(
        "worker", args, tmp_path, cwd=ROOT, env={**_base_env(), **(env or {})}
    )
    return Worker(child, ingress, bootstrap, http_port)


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFILL_WORKER_")}


@pytest.fixture(scope="session")
def shared_worker(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Worker]:
    """configs/tiny-test.yaml as it is (port 0 everywhere) with a ready file, shared by the
    tests that leave it serving. At the end SIGTERM must drain it to exit 0 and remove the
    ready file (a stale one would name dead ports). Session-scoped, so one start per pytest
    process: under ``-n`` a process runs this package's modules between others' (costliest
    first, ``tests/xdist_groups.py``), and a package fixture was stopped and started again
    each time it left the package."""
    tmp_path = tmp_path_factory.mktemp("shared-worker")
    ready_file = tmp_path / "endpoints.json"
    args = [sys.executable, "-m", "prefill_worker", "serve", "configs/tiny-test.yaml"]
    args += ["--set", f"model.path={checkpoint}", "--ready-file", str(ready_file)]
    child = ChildProcess.start("worker", args, tmp_path, cwd=ROOT, env=_base_env())
    try:
        child.wait_ready(120)
        endpoints = json.loads(ready_file.read_text())
        http_port = int(endpoints["http"].rpartition(":")[2])
        yield Worker(child, endpoints["ingress"], endpoints["bootstrap"], http_port, ready_file)
        assert child.stop() == 0, child.log_tail()
        assert not ready_file.exists()
    finally:
        child.kill()


def wait_ready(worker: Worker, timeout_s: float = 120.0) -> None:
    worker.child.wait_ready(timeout_s)


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
        worker.child.kill()


class Decode:
    """A decode peer: its own KV pool (zeros, in the worker's pool layout: its kind, layers,
    KV heads and head size), a KVReceiver, and a page allocator."""

    def __init__(self, bootstrap: str, peer_timeout_s: float = 10.0) -> None:
        layout = describe_worker(bootstrap, 30.0)
        self.k, self.v = decode_pool(
            layout.kind, layout.num_kv_heads, layout.head_dim, layout.num_layers
        )
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=64, peer_timeout_s=peer_timeout_s
        )
        try:
            self.receiver.wait_registered(timeout_s=patient(30))
        except BaseException:  # a refused pool: its I/O thread would keep the process alive
            self.receiver.close()
            raise
        self._next_page = DECODE_PAGES - 1  # hand out descending pages: order bugs show
        self._next_slot = 0
        self.rooms: dict[int, tuple[list[int], int]] = {}

    def want(self, room: int, num_tokens: int, num_cached_tokens: int = 0) -> None:
        """Pages for prompt positions from ``num_cached_tokens`` on (a prefix held here)."""
        count = -(-num_tokens // PAGE_SIZE) - num_cached_tokens // PAGE_SIZE
        pages = [self._next_page - 2 * i for i in range(count)]  # scattered
        self._next_page -= 2 * count
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.rooms[room] = (pages, slot)
        self.receiver.want(room, pages, slot, num_cached_tokens)

    def wait(self, rooms: Sequence[int], timeout_s: float = 60.0) -> dict[int, RoomStatus]:
        def settled() -> bool:
            self.receiver.progress()
            return all(self.receiver.poll(r).state is not RoomState.PENDING for r in rooms)

        wait_until(settled, timeout_s, f"rooms {list(rooms)}")
        return {room: self.receiver.poll(room) for room in rooms}

    def kv(self, room: int, num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the room's prompt as landed here: ``[num_tokens, KV, D]`` each (from
        the first position the room wanted, when the decode held a prefix)."""
        pages, _ = self.rooms[room]
        k = torch.cat([self.k[layer][p] for p in pages])[:num_tokens]
        v = torch.cat([self.v[layer][p] for p in pages])[:num_tokens]
        return k, v

    def close(self) -> None:
        self.receiver.close()


def decode_pool(
    pool_layout: str,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    num_layers: int = NUM_LAYERS,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V ``[DECODE_PAGES, PAGE_SIZE, KV, D]`` views of one pool tensor; an
    ``mla`` pool is one latent tensor per layer and no V."""
    page = (PAGE_SIZE, num_kv_heads, head_dim)
    if pool_layout == "mla":
        return list(torch.zeros((num_layers, DECODE_PAGES, *page))), []
    if pool_layout == "layer_major":
        pool = torch.zeros((num_layers, 2, DECODE_PAGES, *page))
        return list(pool[:, 0]), list(pool[:, 1])
    pool = torch.zeros((DECODE_PAGES, num_layers, 2, *page))
    return [pool[:, i, 0] for i in range(num_layers)], [pool[:, i, 1] for i in range(num_layers)]


@pytest.fixture
def router_factory() -> Iterator[Callable[[str], BlockingRouterClient]]:
    clients: list[BlockingRouterClient] = []

    def factory(endpoint: str) -> BlockingRouterClient:
        clients.append(BlockingRouterClient(endpoint))
        return clients[-1]

    yield factory
    for client in clients:
        client.close()


class _Wanting(Protocol):
    def want(self, room: int, num_tokens: int) -> None: ...

    def wait(self, rooms: list[int]) -> Mapping[int, RoomStatus]: ...


def prefill_claimed(
    router: BlockingRouterClient, decode: _Wanting, prompts: Mapping[int, list[int]]
) -> tuple[Mapping[int, RoomStatus], dict[int, Outcome]]:
    """Each prompt's room wanted by ``decode`` first, then every prompt sent at once: the
    rooms' statuses as the decode saw them and the router's outcomes."""
    for room, ids in prompts.items():
        decode.want(room, len(ids))
    with ThreadPoolExecutor(len(prompts)) as pool:
        sent = {r: pool.submit(router.prefill, ids, r, timeout_s=60) for r, ids in prompts.items()}
        statuses = decode.wait(list(prompts))
        results = {room: future.result(60) for room, future in sent.items()}
    return statuses, results
