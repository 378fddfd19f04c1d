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

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from prefill_worker.testing.json_child import JsonLineChild

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


class SglangDecodeProcess(JsonLineChild):
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
        argv = [python, "-m", "prefill_worker.testing.sglang_decode", str(model_path)]
        super().__init__(
            argv + ([] if attn_tp is None else [f"{attn_tp[0]}/{attn_tp[1]}"]), child_env, log_path
        )


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
        call = command.pop("call", None)  # echoed: the parent drops late answers
        try:
            reply = {"ok": True, **decodes.handle(command)}
        except Exception as exc:  # the test reads the error; the child goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps({**reply, "call": call}) + "\n")
        replies.flush()
        if command["op"] == "quit":
            break
    os._exit(0)  # SGLang's threads are not daemons everywhere: do not wait for them


if __name__ == "__main__":  # pragma: no cover
    main(*sys.argv[1:3])
