"""Runs the worker or the decode peer as a child process, the way systemd would: a
``NOTIFY_SOCKET`` for its sd_notify messages, its output in a log file, SIGTERM to stop.

For the demo, the benchmarks and the tests; the daemon itself never imports it. A collector
thread reads every datagram as it arrives (the kernel queues only about ten), so
``notifications`` holds them all, in order.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_SERIAL = itertools.count()
# The factor by which a child's start and stop may take longer than their timeouts say: 1 for
# benches and scripts; the test suite sets its own (tests/patience.py, from tests/conftest.py).
PATIENCE = 1.0


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_NUM_CANDIDATE_PORTS = 8000  # ports just below the ephemeral range that free_port draws from
_given: set[int] = set()  # ports this process handed out (never twice)
_given_lock = threading.Lock()
_rng = random.Random()  # seeded from the OS: parallel test processes draw differently


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local port of outgoing connections (Linux's default when
    it cannot be read)."""
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(count: int = 1) -> int:
    """A TCP port on 127.0.0.1, free now, for a child to bind later; with ``count``, the first
    of that many consecutive ones, all free (a worker binds a vLLM side channel per version
    from its port on).

    Drawn at random from the ports just below the kernel's ephemeral range, never from it:
    between this check and the child's bind, any outgoing connection on the machine may take
    an ephemeral port (a port from ``bind(0)`` lost that race under load), but none of these.
    Never the same port twice in one process."""
    low, _ = ephemeral_range()
    first = max(1024, low - _NUM_CANDIDATE_PORTS)
    for _ in range(200):
        port = _rng.randrange(first, low - count + 1)
        run = range(port, port + count)
        with _given_lock:
            if any(p in _given or not _is_free(p) for p in run):
                continue
            _given.update(run)
        return port
    raise OSError(f"no {count} free TCP ports in {first}..{low - 1} after 200 tries")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LaunchError(RuntimeError):
    """The child exited or stayed silent while starting; the text ends with its log."""


class ChildProcess:
    def __init__(
        self, name: str, popen: subprocess.Popen[bytes], log_path: Path, notify: socket.socket
    ) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.notifications: list[str] = []
        self._notify = notify
        self._log_offset = 0
        threading.Thread(target=self._collect, name=f"{name}-notify", daemon=True).start()

    @classmethod
    def start(
        cls,
        name: str,
        args: Sequence[str],
        workdir: Path,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ChildProcess:
        """Start ``args`` with its own notify socket and log file under ``workdir``."""
        stem = f"{name}-{next(_SERIAL)}"  # short: a unix socket path holds 107 bytes
        notify_path = workdir / f"{stem}.notify"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        log_path = workdir / f"{stem}.log"
        child_env = {
            **(os.environ if env is None else env),
            "NOTIFY_SOCKET": str(notify_path),
            "NIXL_LOG_LEVEL": "WARN",
        }
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                list(args), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=child_env
            )
        return cls(name, popen, log_path, notify)

    def is_ready(self) -> bool:
        """READY=1 arrived; raises ``LaunchError`` if the child has exited."""
        if self.popen.poll() is not None:
            raise LaunchError(self._failure(f"exited with {self.popen.returncode}"))
        return any(n.startswith("READY=1") for n in self.notifications)

    def wait_ready(
        self, timeout_s: float, on_log_line: Callable[[str], None] | None = None
    ) -> None:
        """Block until READY=1 (up to ``timeout_s`` times ``PATIENCE``), handing each new log
        line to ``on_log_line`` meanwhile."""
        timeout_s *= PATIENCE
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if on_log_line is not None:
                for line in self.new_log_lines():
                    on_log_line(line)
            if time.monotonic() > deadline:
                raise LaunchError(self._failure(f"not ready after {timeout_s:g} s"))
            time.sleep(0.05)

    def new_log_lines(self) -> list[str]:
        text = self.log_path.read_text(errors="replace")
        new, self._log_offset = text[self._log_offset :], len(text)
        return [line for line in new.splitlines() if line.strip()]

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; a child that does not exit in time (``timeout_s`` times
        ``PATIENCE``) is killed."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout_s * PATIENCE)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._notify.close()
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self._notify.close()

    def _collect(self) -> None:
        self._notify.settimeout(0.2)
        while self._notify.fileno() != -1:
            try:
                self.notifications.append(self._notify.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def _failure(self, what: str) -> str:
        return f"{self.name} {what}; log {self.log_path}:\n{self.log_tail()}"
