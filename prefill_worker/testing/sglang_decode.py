"""SGLang's own decode-side transfer code as a decode node, for the interop tests.

A test tool, not the worker. The child side (``python -m prefill_worker.testing.sglang_decode
--model-path DIR``) runs in an environment where a pinned ``sglang`` is importable (``make
interop-deps`` builds one per version under ``.interop/``; ``tests/interop/stubs`` stands in
for triton and torchvision): it builds SGLang's ``NixlKVManager`` in decode mode on the CPU
with the real ``MHATokenToKVPool`` and ``MetadataBuffers`` (memory kind DRAM), and for each
room a ``NixlKVReceiver`` that bootstraps from a prefill and sends its transfer request,
exactly as an SGLang decode server does. It takes one JSON command per line on stdin and
answers one JSON line on stdout (SGLang's own output goes to stderr). Several decodes (each
its own manager, pools and NIXL agent) may live in one process: an SGLang import costs
seconds, a decode milliseconds.

The parent side is ``SglangDecodeProcess`` (plain Python, no SGLang): it starts the child
with the environment for one version and turns calls into commands.

Commands (every reply has ``ok``; a failure has ``error``)::

    new      id, bootstrap (host:port), page_size, dtype, num_layers, num_kv_heads, head_dim,
             num_pages, num_aux_rows, kind    a decode; its pools filled with FILL_BYTE (kind
             mla: SGLang's MLA pool, head_dim the latent width)
    want     id, room, num_tokens, prefix_len       pages for the prompt (scattered), an aux
             row, the receiver bootstrapped, its transfer request sent -> pages, aux_index
    poll     id, room                   -> state (SGLang's KVPoll name), reason when Failed
    dump     id, room, path             the room's pages (bytes per layer: K and V, or the
                                        latent) and its aux row fields, as .npz at path
    free     id, room                   a concluded room's pages back to the pool
    abort    id, room                   receiver.abort() (ABORT to the prefill)
    acked    id, room                   -> acked: the prefill's ABORT_ACK arrived
    quit

``python -m prefill_worker.testing.sglang_decode MODEL [RANK/SIZE]``: with RANK/SIZE the
process is that rank of a decode's attention TP group.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILL_BYTE = 0xAB  # every byte of a fresh decode pool: what no write leaves behind
INTEROP_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",  # SGLang's floor; fails rooms in ~4 s
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",  # ABORT waits for ABORT_ACK
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


class DecodeError(RuntimeError):
    """The child refused a command or went away; the text carries its error and log."""


class SglangDecodeProcess:
    """The child process, seen from a test: ``call(op, **fields)`` returns its reply."""

    def __init__(
        self,
        python: str,
        pythonpath: list[Path],
        model_path: Path,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, str] | None = None,
        attn_tp: tuple[int, int] | None = None,
    ) -> None:
        """``overrides`` go over ``INTEROP_ENV`` (SGLang's default heartbeat, say);
        ``attn_tp`` (rank, size) makes the process one rank of a decode's attention TP group
        (its decodes register as that rank; their pools hold that rank's KV heads)."""
        child_env = {**(os.environ if env is None else env), **INTEROP_ENV, **(overrides or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [python, "-m", "prefill_worker.testing.sglang_decode", str(model_path)]
                + ([] if attn_tp is None else [f"{attn_tp[0]}/{attn_tp[1]}"]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env,
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


def main(model_path: str, attn_tp: str = "0/1") -> None:  # pragma: no cover - interop env
    """The child: stdout carries replies only (everything else printed goes to stderr).
    ``attn_tp`` is "rank/size" of its attention TP group."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from prefill_worker.testing.sglang_child import Decodes

    rank, size = (int(x) for x in attn_tp.split("/"))
    decodes = Decodes(model_path, FILL_BYTE, (rank, size))
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply = {"ok": True, **decodes.handle(command)}
        except Exception as exc:  # the test reads the error; the child goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
        if command["op"] == "quit":
            break
    os._exit(0)  # SGLang's threads are not daemons everywhere: do not wait for them


if __name__ == "__main__":  # pragma: no cover
    main(*sys.argv[1:3])
