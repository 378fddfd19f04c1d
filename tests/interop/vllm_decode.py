"""vLLM's own ``NixlConnector`` worker half as a decode (0.33 or 0.34, ``VLLM_VERSIONS``), for
the interop tests: the parent side (plain Python, no vLLM). The child
(``tests/interop/vllm_child.py``) runs on this venv's python with ``PYTHONPATH`` = the
repository and ``.interop/vllm-<version>`` (``make vllm-deps``: vLLM and its pure-Python
imports without their dependencies, and a ``nixl`` package re-exporting ``nixl_cu12``),
``VLLM_TARGET_DEVICE=cpu``.

Commands (one JSON line each; every reply has ``ok``, a failure ``error``; every wait has a
deadline, so a test never hangs)::

    info                        -> engine_id, compat_hash (vLLM's, for its own config),
                                   attn_backend_name, block_bytes, num_blocks
    pull     request_id, params (a prefill's kv_transfer_params), num_local (optional;
             0 = a full local prefix hit, notification only)   -> blocks (local ids)
    push     request_id, params, num_local (optional: the uncached blocks)   a push
             decode's request: its PUSH_REG goes to the prefill on the next step -> blocks
    wait     request_id, timeout_s   -> finished, load_errors (local ids in
                                   get_block_ids_with_load_errors()), blocks
    dump     request_id, path    the request's local blocks per layer (raw bytes,
                                   [n, kv_heads, block_size, 2*head_dim]) as .npz
    hold     request_id, params, interval_s   the request waits in the queue: vLLM's
                                   "HB:<remote_request_id>" heartbeats every interval_s
    release  request_id          stops the heartbeats
    hash     spec (model_dir, dtype, block_size, attn_backend_name, cache_dtype)
                                -> compat_hash: vLLM's compute_nixl_compatibility_hash
    meta                         -> payload: a push decode rank's handshake payload (hex)
    serve    payloads            rank 0 of a push decode of TP > 1 serves every rank's
                                   payload (hex, in rank order) on its side channel
    open     name, spec          another decode in the process (the first's TP rank of
                                   its TP size; vLLM's import and distributed state
                                   shared), its spec the first's with ``spec``'s changes
                                   (``cache_dtype``: its kv_cache_dtype, ``engine_id``,
                                   ``model_dir``, ``transfer_mode``, ``side_channel_port``);
                                   a command with ``decode: name`` is its
    quit
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefill_worker.testing.json_child import JsonLineChild
from prefill_worker.testing.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSIONS = ("0.33.0", "0.34.0")  # the Makefile's VLLM_VERSIONS
# Push mode's decodes (each imports vLLM, ~1 min): the newest by default, to keep `make
# interop` short; PW_VLLM_PUSH_VERSIONS="0.33.0 0.34.0" runs both (both passed when built).
VLLM_PUSH_VERSIONS = tuple(os.environ.get("PW_VLLM_PUSH_VERSIONS", VLLM_VERSIONS[-1]).split())
INTEROP_DIR = Path(os.environ.get("PW_INTEROP_DIR", ROOT / ".interop"))
FILL_BYTE = 0xAB  # every byte of a fresh decode cache: what no READ leaves behind
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_pythonpath(version: str) -> list[Path]:
    """The child's PYTHONPATH; skips the test when the environment is not installed."""
    directory = INTEROP_DIR / f"vllm-{version}"
    if not (directory / ".installed").exists():
        pytest.skip(
            f"vLLM {version} interop environment missing ({directory}): run `make vllm-deps`"
        )
    return [ROOT, directory]


class VllmDecodeProcess(JsonLineChild):
    """The child, seen from a test: ``call(op, **fields)`` returns its reply. It starts
    importing vLLM at once (seconds); the first call waits for it."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        num_blocks: int = 64,
        engine_id: str = "vllm-decode",
        block_size: int = 32,
        dtype: str = "float32",
        version: str = VLLM_VERSIONS[0],
        tp: tuple[int, int, int] | None = None,
        transfer_mode: str = "pull",
        side_channel_port: int | None = None,
    ) -> None:
        """``tp``: (rank, size, dist_port) of one rank of a decode of TP size (its ranks
        share the port); None: TP 1. ``transfer_mode`` "push": vLLM's ``NixlPushConnector``,
        serving its own side channel (vLLM's listener) on ``side_channel_port`` (default a
        free port); at TP > 1 every rank names the same port and rank 0 serves it once
        given every rank's ``meta`` (``serve``)."""
        self.version = version
        rank, size, dist_port = tp or (0, 1, free_port())
        spec = {
            "model_dir": str(model_dir),
            "num_blocks": num_blocks,
            "engine_id": engine_id,
            "block_size": block_size,
            "dtype": dtype,
            "fill_byte": FILL_BYTE,
            "dist_port": dist_port,
            "tp_rank": rank,
            "tp_size": size,
            "transfer_mode": transfer_mode,
            "side_channel_port": side_channel_port or free_port(),
        }
        env = {**os.environ, **VLLM_ENV}
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in vllm_pythonpath(version))
        # vLLM caches what it learns of a model class (a subprocess that imports it, seconds
        # of CPU) by the class's file hash, one file per class whatever the version: a cache
        # of its own per version, else 0.33's and 0.34's differing qwen3.py evict each other.
        env["VLLM_CACHE_ROOT"] = str(INTEROP_DIR / f"vllm-{version}" / ".vllm-cache")
        argv = [sys.executable, "-m", "tests.interop.vllm_child", json.dumps(spec)]
        super().__init__(argv, env, log_path, cwd=ROOT)

    def open(self, name: str, **spec: Any) -> OpenedDecode:
        """Another decode in this process (``open``), e.g. one with an FP8 cache."""
        self.call("open", timeout_s=120, name=name, spec=spec)
        return OpenedDecode(self, name)

    def pull_and_wait(
        self, request_id: str, params: dict[str, Any], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """Pull, then wait (the child's deadline, ours a little later) -> wait's reply."""
        self.call("pull", request_id=request_id, params=params)
        return self.call(
            "wait", timeout_s=timeout_s + 30, request_id=request_id, deadline_s=timeout_s
        )

    def push_and_wait(
        self, request_id: str, params: dict[str, Any], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """A push decode's request: its blocks registered with the prefill, then wait (as
        ``pull_and_wait``) for the prefill's WRITE and its notification."""
        self.call("push", request_id=request_id, params=params)
        return self.call(
            "wait", timeout_s=timeout_s + 30, request_id=request_id, deadline_s=timeout_s
        )

    def blocks(self, request_id: str, path: Path) -> dict[str, np.ndarray]:
        """The request's pulled blocks per layer (uint8 ``[n, heads, block_size, 2*dim*es]``)."""
        self.call("dump", request_id=request_id, path=str(path))
        with np.load(path) as npz:
            return {name: npz[name] for name in npz.files}


class OpenedDecode:
    """A decode ``VllmDecodeProcess.open`` started beside the first: its commands carry its
    name."""

    def __init__(self, process: VllmDecodeProcess, name: str) -> None:
        self.process, self.name = process, name

    def call(self, op: str, timeout_s: float = 120.0, **fields: Any) -> dict[str, Any]:
        return self.process.call(op, timeout_s, decode=self.name, **fields)

    def pull_and_wait(
        self, request_id: str, params: dict[str, Any], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        self.call("pull", request_id=request_id, params=params)
        return self.call(
            "wait", timeout_s=timeout_s + 30, request_id=request_id, deadline_s=timeout_s
        )

    def blocks(self, request_id: str, path: Path) -> dict[str, np.ndarray]:
        self.call("dump", request_id=request_id, path=str(path))
        with np.load(path) as npz:
            return {name: npz[name] for name in npz.files}
