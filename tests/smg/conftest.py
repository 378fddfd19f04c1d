"""The real SGLang PD router (smg, pinned by ``make smg``) in front of real worker processes
(their HTTP API front) and the reference decode peer serving SGLang's decode HTTP API.

Every test runs on two stacks (the ``stack`` fixture's ``protocol``):

- ``sglang``: the drop-in. The workers speak SGLang's PD protocol (``transfer.protocol=
  sglang``), smg is given their SGLang bootstrap ports, and the decode peer receives the KV
  with SGLang's own decode-side code (``decode_peer --sglang``, in the pinned SGLang 0.5.23
  environment of ``make interop-deps``). Marked ``interop``: ``make interop`` runs them;
  skipped, saying so, when that environment is missing.
- ``native``: the same through our own bootstrap protocol (``make test``).

Skipped when ``make smg`` has not installed the router (``.interop/smg``); CI installs it.
Everything is a child process on 127.0.0.1: ``Stack`` starts them and stops them in order."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from prefill_worker.testing.launch import ChildProcess, free_port
from prefill_worker.testing.sglang_env import InteropMissing, sglang_env
from prefill_worker.testing.spare import WAITING
from tests.checkpoints import make_checkpoint
from tests.integration.daemon.conftest import Worker, start_worker
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
SMG = ROOT / ".interop" / "smg" / "bin" / "smg"
MODEL_NAME = "tiny-llama"
SPARE = "prefill_worker.testing.spare"  # a warm spare of the worker (restarts)


def sse_events(raw: str) -> list[object]:
    """``data:`` payloads of a server-sent event stream, ``[DONE]`` as the string."""
    payloads = [
        line[len("data:") :].strip() for line in raw.splitlines() if line.startswith("data:")
    ]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def http(url: str, body: object | None = None, timeout_s: float = 60.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


@dataclass
class Prefill:
    worker: Worker
    api_port: int
    sglang_port: int | None  # SGLang's bootstrap port, when it speaks SGLang's protocol

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def bootstrap_port(self) -> int:
        """What the router passes on to the decode as ``bootstrap_port``."""
        if self.sglang_port is not None:
            return self.sglang_port
        return int(self.worker.bootstrap.rpartition(":")[2])

    def metric(self, pattern: str) -> float:
        """The sum of the worker's /metrics samples whose line starts with ``pattern``."""
        text = self.worker.http("/metrics")[1]
        lines = [line for line in text.splitlines() if line.startswith(pattern)]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@dataclass
class Stack:
    tmp_path: Path
    checkpoint: Path
    protocol: str  # "sglang" or "native"
    prefills: list[Prefill] = field(default_factory=list)
    children: list[ChildProcess] = field(default_factory=list)
    decode_ports: list[int] = field(default_factory=list)
    router_port: int = 0
    router_metrics_port: int = 0

    @property
    def decode_port(self) -> int:
        """The first decode peer's port (most tests start one)."""
        return self.decode_ports[0]

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.decode_port}/generate"

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def start_prefill(self, *settings: str) -> Prefill:
        port = free_port()
        sglang_port = free_port() if self.protocol == "sglang" else None
        worker = start_worker(
            self.tmp_path, self.checkpoint, *self._flags(port, sglang_port, *settings)
        )
        self.children.append(worker.child)
        worker.child.wait_ready(120)
        self.prefills.append(Prefill(worker, port, sglang_port))
        return self.prefills[-1]

    def restart_prefill(self, prefill: Prefill, sig: signal.Signals, *settings: str) -> float:
        """Signal the prefill, and start it again on the same ports from a warm spare (its
        imports done beforehand, so it is back within seconds); when the new run is ready."""
        spare = self.start_spare(prefill, *settings)
        prefill.worker.proc.send_signal(sig)
        self.wait_exit(prefill, 30)
        return self.swap_in(prefill, spare)

    def start_spare(self, prefill: Prefill, *settings: str) -> Worker:
        """A warm spare of the prefill, on its ports once ``swap_in`` wakes it."""
        flags = self._flags(prefill.api_port, prefill.sglang_port, *settings)
        flags += (f"transfer.bootstrap_bind={prefill.worker.bootstrap}",)
        spare = start_worker(self.tmp_path, self.checkpoint, *flags, module=SPARE)
        self.children.append(spare.child)
        wait_until(lambda: WAITING in spare.child.log_tail(), 120, "the spare's imports")
        return spare

    def wait_exit(self, prefill: Prefill, timeout_s: float) -> int:
        code = prefill.worker.wait_exit(timeout_s)
        self.children.remove(prefill.worker.child)
        return code

    def swap_in(self, prefill: Prefill, spare: Worker) -> float:
        """Wake the spare in the place of the prefill (which has exited); when it is ready."""
        spare.proc.send_signal(signal.SIGUSR1)
        spare.child.wait_ready(120)
        prefill.worker = dataclasses.replace(spare, bootstrap=prefill.worker.bootstrap)
        return time.monotonic()

    def _flags(self, port: int, sglang_port: int | None, *settings: str) -> tuple[str, ...]:
        flags: tuple[str, ...] = (
            "http_api.enabled=true",
            f"http_api.bind=127.0.0.1:{port}",
            f"http_api.served_model_name={MODEL_NAME}",
            "metrics.allow_unauthenticated_admin=true",
        )
        if sglang_port is not None:
            flags += (
                "transfer.protocol=sglang",
                f"transfer.sglang_bootstrap_bind=127.0.0.1:{sglang_port}",
                "transfer.sglang_rejoin_s=0",  # no restart in most tests
            )
        return flags + settings

    def start_decode(self) -> None:
        self.decode_ports.append(free_port())
        args = [sys.executable, "-m", "prefill_worker.testing.decode_peer"]
        args += ["--model", str(self.checkpoint), "--http", f"127.0.0.1:{self.decode_ports[-1]}"]
        env = None
        if self.protocol == "sglang":
            env = sglang_env(ROOT)  # the stack fixture skipped if it is missing
            args += ["--sglang"]
        for prefill in self.prefills:
            where = f"127.0.0.1:{prefill.sglang_port}" if prefill.sglang_port else None
            args += ["--bootstrap", where or prefill.worker.bootstrap]
        args += ["--served-model-name", MODEL_NAME, "--dtype", "float32", "--page-size", "4"]
        args += ["--num-pages", "512", "--attention-backend", "sdpa", "--num-threads", "1"]
        args += ["--ignore-eos"]
        child = ChildProcess.start("decode-peer", args, self.tmp_path, cwd=ROOT, env=env)
        self.children.insert(0, child)
        child.wait_ready(120)

    def start_router(self, *flags: str) -> None:
        self.router_port, self.router_metrics_port = free_port(), free_port()
        args = [str(SMG), "launch", "--pd-disaggregation", "--host", "127.0.0.1"]
        args += ["--port", str(self.router_port), "--prometheus-port"]
        args += [str(self.router_metrics_port), "--prometheus-host", "127.0.0.1"]
        for prefill in self.prefills:
            args += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
        for port in self.decode_ports:
            args += ["--decode", f"http://127.0.0.1:{port}"]
        args += ["--policy", "round_robin", "--worker-startup-check-interval", "1"]
        args += ["--retry-initial-backoff-ms", "10", "--log-level", "info", *flags]
        child = ChildProcess.start("smg", args, self.tmp_path, cwd=ROOT)
        self.children.insert(0, child)
        num = len(self.prefills) + len(self.decode_ports)
        wait_until(lambda: self.num_healthy_workers() == num, 60, "smg registration and health")

    def num_healthy_workers(self) -> int:
        """Workers smg has registered and found healthy: it routes only to those (a request
        sent between the two gets smg's 503, "no available prefill workers")."""
        try:
            status, body = http(f"{self.router}/workers", timeout_s=2)
        except OSError:
            return 0
        workers = body.get("workers", []) if status == 200 else []
        return sum(1 for worker in workers if worker.get("is_healthy"))

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        return http(f"{self.router}/generate", {"model": MODEL_NAME, **body})

    def stop(self) -> dict[str, int]:
        return {child.name: child.stop(30) for child in self.children}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("smg-ckpt") / "llama")


def require_smg() -> None:
    """Skip without the router; CI runs `make smg` first: there a missing router is a failure."""
    if not SMG.exists():
        message = "smg is not installed: `make smg`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


PROTOCOLS = [pytest.param("sglang", marks=pytest.mark.interop), "native"]


def new_stack(protocol: str, tmp_path: Path, checkpoint: Path) -> Stack:
    """An empty stack; skips (or fails, under CI) where smg or SGLang's environment is missing."""
    require_smg()
    if protocol == "sglang":
        try:
            sglang_env(ROOT)
        except InteropMissing as exc:
            pytest.skip(f"the SGLang-mode decode peer needs it: {exc}")
    return Stack(tmp_path, checkpoint, protocol)


@pytest.fixture(params=PROTOCOLS)
def stack(request: pytest.FixtureRequest, tmp_path: Path, checkpoint: Path) -> Iterator[Stack]:
    started = new_stack(request.param, tmp_path, checkpoint)
    yield started
    for child in started.children:
        child.kill()


@pytest.fixture(scope="module", params=PROTOCOLS)
def plain_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[Stack]:
    """One prefill, one decode peer and smg, started once for the module's tests that only
    send requests through them (starting a stack is most of such a test's time). Stopped at
    the end: every child exits 0 on SIGTERM, or the last test using it errors."""
    tmp_path = tmp_path_factory.mktemp(f"plain-stack-{request.param}")
    started = new_stack(request.param, tmp_path, checkpoint)
    try:
        started.start_prefill()
        started.start_decode()
        started.start_router()
        yield started
        codes = started.stop()
        assert all(code == 0 for code in codes.values()), codes
    finally:
        for child in started.children:
            child.kill()
