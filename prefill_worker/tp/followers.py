"""The follower rank processes a leader starts, watches and stops.

Each follower is ``command + [--rank R --world-size N --port P --parent-pid PID]`` with the
group's secret (``tp.secret``) and the resolved configuration as JSON on its stdin (no second
reading of files or env; no other process can read a pipe, unlike argv). A follower dies
with its leader whatever kills the leader: it asks the kernel for SIGKILL when its parent
exits (``PR_SET_PDEATHSIG``, ``die_with_parent``) and checks the parent did not exit before
it asked. The leader's waits on the group (rendezvous, the load barrier) run beside a watch
of these processes, so a follower that exits while the leader waits fails the start at once
instead of after a timeout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


class Followers:
    def __init__(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        self._procs = list(procs)  # index i: rank i + 1

    @staticmethod
    def start(
        command: Sequence[str], config_json: bytes, size: int, port: int, secret: bytes
    ) -> Followers:
        """Each follower's stdin: the group's secret in hex on the first line, then the
        configuration (``read_stdin``)."""
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, size):
                args = [*command, "--rank", str(rank), "--world-size", str(size)]
                args += ["--port", str(port), "--parent-pid", str(os.getpid())]
                proc = subprocess.Popen(args, stdin=subprocess.PIPE)
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(secret.hex().encode() + b"\n" + config_json)
                proc.stdin.close()
        except BaseException:
            Followers(procs).kill()
            raise
        log.info("tensor parallel: started ranks 1..%d (pids %s)", size - 1, Followers(procs).pids)
        return Followers(procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def first_dead(self) -> str | None:
        """``rank R (pid P) exited with C`` for the first follower that is gone, else None."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"rank {rank} (pid {proc.pid}) exited with {code}"
        return None

    def first_stopped(self) -> str | None:
        """``rank R (pid P) is stopped`` for the first follower the kernel holds stopped
        (SIGSTOP, a debugger; state T or t in ``/proc``), else None. Such a rank answers
        nothing, in a step or in the forward's own collectives, until it is continued."""
        for rank, proc in enumerate(self._procs, start=1):
            if _state(proc.pid) in ("T", "t"):
                return f"rank {rank} (pid {proc.pid}) is stopped"
        return None

    def wait_for(self, work: Callable[[], T], timeout_s: float, what: str) -> T:
        """``work()`` (a blocking collective), failing at once if a follower exits and with
        ``TimeoutError`` after ``timeout_s``: never a hang at start-up."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["result"] = work()
            except BaseException as exc:  # handed to the waiting thread below
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"tp {what}", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(_POLL_S)
            dead = self.first_dead()
            if dead is not None and thread.is_alive():
                raise RuntimeError(f"{what}: {dead}")
            if time.monotonic() >= deadline and thread.is_alive():
                raise TimeoutError(f"{what}: not every rank answered within {timeout_s:g} s")
        if "error" in box:
            if time.monotonic() >= deadline:  # the collective's own timeout (the same bound)
                raise TimeoutError(f"{what}: not every rank answered within {timeout_s:g} s")
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]

    def close(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the followers to leave (after a stop step), then kill
        what is left; returns when every one is reaped."""
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel: rank pid %d did not stop; killing it", proc.pid)
        self.kill()

    def kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        raise SystemExit(f"leader pid {parent_pid} is gone")


def _state(pid: int) -> str | None:
    """The process's state letter from ``/proc/PID/stat`` (None where it cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    return fields[0] if fields else None


def read_stdin(data: bytes) -> tuple[bytes, bytes]:
    """A follower's stdin (``Followers.start``): the group's secret and the configuration."""
    line, _, config_json = data.partition(b"\n")
    return bytes.fromhex(line.decode("ascii")), config_json
