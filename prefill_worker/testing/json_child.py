"""A child process driven by JSON lines, for the interop tests' decodes (SGLang's, vLLM's):
one command per line on its stdin, one reply per line on its stdout (every reply has ``ok``, a
failure ``error``), everything else it prints in a log file. Every call has a deadline, so a
test never hangs on a child that went quiet."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


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

    def call(self, op: str, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        try:
            self.popen.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            self.popen.stdin.flush()
        except BrokenPipeError:
            raise DecodeError(self._failure(f"{op}: the decode is gone")) from None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout_s)
        line = self.popen.stdout.readline() if ready else b""
        if not line:
            raise DecodeError(self._failure(f"{op}: no answer within {timeout_s:g} s"))
        reply: dict[str, Any] = json.loads(line)
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

    def _failure(self, what: str) -> str:
        return f"{what}; log {self.log_path}:\n{self.log_tail()}"
