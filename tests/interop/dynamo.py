"""Dynamo's standalone KV indexer as a child process, and its HTTP API, for the interop tests.

``make kv-events-deps`` installs it (the pins: ``tests/interop/dynamo-requirements.txt``) into
``.interop/dynamo``; without it the tests skip and say so. What ai-dynamo-runtime 1.6.1 serves
(read off its ``--help`` and its answers)::

    python -m dynamo.indexer --block-size B --port P --workers "ID=tcp://HOST:PORT[,...]"
    POST /query {"token_ids": [...], "model_name": "default"}
         → {"scores": {"ID": {"DP_RANK": matched_tokens}}, ...}   (matched blocks × B)
    GET  /dump    → {"default:default": {"block_size": B, "events": [{"worker_id": ID,
                     "event": {"data": {"stored": {"blocks": [{"block_hash": H, ...}]}}}}]}}
    GET  /workers → [{"instance_id": ID, "listeners": {"0": {"status": "active"}}, ...}]
    POST /register {"instance_id": ID, "endpoint": PUB, "replay_endpoint": ROUTER,
                    "model_name": "default", "block_size": B}     (instead of --workers)

It computes its own hash of each block's token ids (so a query needs only tokens) and links
blocks through the published ``block_hashes`` / ``parent_block_hash`` chain.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from prefill_worker.testing.launch import ChildProcess, free_port
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_ENV = ROOT / ".interop" / "dynamo"
REQUIREMENTS = Path(__file__).with_name("dynamo-requirements.txt")
MODEL_NAME = "default"


def dynamo_python() -> Path:
    """The pinned install's interpreter; skips the test when it is missing."""
    if not (DYNAMO_ENV / ".installed").exists():
        pytest.skip("Dynamo's KV indexer is not installed: run `make kv-events-deps`")
    python = DYNAMO_ENV / "bin" / "python"
    pinned = next(
        line.split("==")[1]
        for line in REQUIREMENTS.read_text().splitlines()
        if line.startswith("ai-dynamo-runtime==")
    )
    installed = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; print(m.version('ai-dynamo-runtime'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if installed != pinned:
        pytest.fail(
            f"{DYNAMO_ENV} has ai-dynamo-runtime {installed}, the pin is {pinned}: rerun make"
        )
    return python


class DynamoIndexer:
    def __init__(self, child: ChildProcess, port: int, block_size: int) -> None:
        self.child, self.port, self.block_size = child, port, block_size

    @classmethod
    def start(cls, workdir: Path, block_size: int, workers: Mapping[int, str]) -> DynamoIndexer:
        """Started and subscribed to every worker's PUB endpoint (``{worker_id: endpoint}``)."""
        python = dynamo_python()
        port = free_port()
        spec = ",".join(f"{worker_id}={endpoint}" for worker_id, endpoint in workers.items())
        args = [str(python), "-m", "dynamo.indexer", "--block-size", str(block_size)]
        args += ["--port", str(port), "--threads", "1", "--workers", spec]
        indexer = cls(ChildProcess.start("dynamo-indexer", args, workdir), port, block_size)
        wait_until(lambda: indexer._listening(set(workers)), 60, "the indexer's listeners")
        return indexer

    @classmethod
    def start_registered(
        cls, workdir: Path, block_size: int, worker_id: int, endpoint: str, replay_endpoint: str
    ) -> DynamoIndexer:
        """Started with no worker, then one registered over HTTP with its replay socket: on a
        gap in the sequence numbers (a late join, a restarted worker) it fetches the batches
        it missed."""
        python = dynamo_python()
        port = free_port()
        args = [str(python), "-m", "dynamo.indexer", "--block-size", str(block_size)]
        args += ["--port", str(port), "--threads", "1"]
        indexer = cls(ChildProcess.start("dynamo-indexer", args, workdir), port, block_size)
        wait_until(indexer._is_serving, 60, "the indexer's HTTP server")
        registration = {"instance_id": worker_id, "endpoint": endpoint}
        registration |= {"replay_endpoint": replay_endpoint, "model_name": MODEL_NAME}
        indexer._call("/register", {**registration, "block_size": block_size})
        wait_until(lambda: indexer._listening({worker_id}), 60, "the indexer's listener")
        return indexer

    def overlap_blocks(self, token_ids: list[int]) -> dict[int, int]:
        """``{worker_id: blocks}`` the indexer says each worker holds of this prompt's prefix."""
        answer = self._call("/query", {"token_ids": token_ids, "model_name": MODEL_NAME})
        blocks = {}
        for worker_id, by_rank in answer["scores"].items():
            num_tokens = sum(by_rank.values())
            assert num_tokens % self.block_size == 0, answer
            blocks[int(worker_id)] = num_tokens // self.block_size
        return blocks

    def indexed_block_hashes(self) -> set[int]:
        """Every block hash ``GET /dump`` lists as stored, over all workers."""
        dumped = self._call("/dump")
        hashes = set()
        for indexer in dumped.values():
            for event in indexer["events"]:
                stored = event["event"]["data"]["stored"]
                hashes |= {block["block_hash"] for block in stored["blocks"]}
        return hashes

    def close(self) -> None:
        self.child.kill()

    def _is_serving(self) -> bool:
        if self.child.popen.poll() is not None:
            raise AssertionError(f"the indexer exited:\n{self.child.log_tail()}")
        try:
            self._call("/workers")
        except (urllib.error.URLError, ConnectionError):
            return False
        return True

    def _listening(self, worker_ids: set[int]) -> bool:
        if self.child.popen.poll() is not None:
            raise AssertionError(f"the indexer exited:\n{self.child.log_tail()}")
        try:
            workers = self._call("/workers")
        except (urllib.error.URLError, ConnectionError):
            return False
        active = {
            w["instance_id"]
            for w in workers
            if w["listeners"] and all(x["status"] == "active" for x in w["listeners"].values())
        }
        return worker_ids <= active

    def _call(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
