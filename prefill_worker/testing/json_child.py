"""A child process driven by JSON lines, for the interop tests' decodes (SGLang's, vLLM's):
one command per line on its stdin, one reply per line on its stdout (every reply has ``ok``, a
failure ``error``), everything else it prints in a log file. Every call has a deadline, so a
test never hangs on a child that went quiet. Every command carries a number (``call``) that its
reply echoes: a reply that comes after its call's deadline is dropped by the next call, never
read as that call's answer (a slow child then fails one call, not every call after it)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefill_worker.testing import launch


class DecodeError(RuntimeError):
    """The child refused a command or went away; the text carries its error and log."""


class JsonLineChild:
    """The child, seen from a test: ``call(op, **fields)`` returns its reply."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path | None = None,
    ) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=dict(env),
                cwd=cwd,
            )
        self._num_calls = 0
        self._unread = b""  # what the child wrote past the last line read

    def call(self, op: str, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self._num_calls += 1
        number = self._num_calls
        try:
            command = {"op": op, **fields, "call": number}
            self.popen.stdin.write(json.dumps(command).encode() + b"\n")
            self.popen.stdin.flush()
        except BrokenPipeError:
            raise DecodeError(self._failure(f"{op}: the decode is gone")) from None
        timeout_s *= launch.PATIENCE  # the tests' factor for a busy machine (launch.py)
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._read_line(deadline)
            if line is None:
                raise DecodeError(self._failure(f"{op}: no answer within {timeout_s:g} s"))
            reply: dict[str, Any] = json.loads(line)
            if reply.get("call") == number:
                break  # an earlier call's late answer is dropped
        if not reply["ok"]:
            raise DecodeError(f"{op}: {reply['error']}")
        return reply

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(DecodeError):  # it is killed next anyway
                self.call("quit", timeout_s=10)
        self.kill()

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def _read_line(self, deadline: float) -> bytes | None:
        """The child's next line, or None at the deadline or if it closed its stdout. Reads
        the pipe's file descriptor itself: a buffered reader could hold the next line where
        ``select`` does not see it."""
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        while b"\n" not in self._unread:
            left_s = max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left_s)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line

    def _failure(self, what: str) -> str:
        return f"{what}; log {self.log_path}:\n{self.log_tail()}"
