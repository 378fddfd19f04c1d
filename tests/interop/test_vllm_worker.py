"""vLLM 0.33's own NixlConnector (``vllm_decode``) pulling from the real worker process
(``transfer.protocol: native,vllm``) over the HTTP path: a proxy-shaped client sends the
worker what vLLM's proxy sends, carries the answer's ``kv_transfer_params`` to the decode
process, and vLLM pulls transformers' K/V (fp32, 1e-4) for prompts around its 32-token block
over the worker's 4-token pages, with no load errors; a full local prefix hit only notifies;
a request that waits in vLLM's queue heartbeats its hold past the worker's lease; every
staging block comes back (the worker's metrics). One worker and one decode for the module.
(The wrong-hash refusal is test_vllm_pull.py's, over the same handshake code.)"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import Worker, free_port, start_worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.vllm_decode import VllmDecodeProcess, vllm_pythonpath
from tests.polling import wait_until

pytestmark = pytest.mark.interop

BLOCK = 32
LEASE_S = 4.0
PROXY_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, str, Path]]:
    vllm_pythonpath()  # skip before starting anything
    tmp = tmp_path_factory.mktemp("vllm-worker")
    checkpoint = make_checkpoint("qwen3", tmp / "qwen3")  # head_dim 32: CPU_ATTN has it
    api_port = free_port()
    worker = start_worker(
        tmp,
        checkpoint,
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{api_port}",
        "transfer.protocol=native,vllm",
        f"transfer.vllm_side_channel_port={free_port()}",
        f"transfer.vllm_block_size={BLOCK}",
        "transfer.vllm_staging_blocks=24",
        f"transfer.vllm_lease_s={LEASE_S}",
        "transfer.vllm_read_grace_s=0.5",
        f"transfer.vllm_model={checkpoint}",  # the decode's --model: its hash covers it
        "transfer.vllm_attention_backend=CPU_ATTN",
    )
    try:
        worker.child.wait_ready(120)
        yield worker, f"http://127.0.0.1:{api_port}", checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(scope="module")
def decode(served: tuple[Worker, str, Path]) -> Iterator[VllmDecodeProcess]:
    checkpoint = served[2]
    process = VllmDecodeProcess(checkpoint, checkpoint.parent / "decode.log", num_blocks=64)
    assert process.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"  # vLLM is up
    yield process
    process.close()


def _prefill(api: str, ids: list[int]) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": 1, "stream": False, "kv_transfer_params": PROXY_ASK}
    request = urllib.request.Request(
        f"{api}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return dict(json.loads(response.read())["kv_transfer_params"])


def _metric(worker: Worker, name: str, labels: str = "") -> float:
    _, text = worker.http("/metrics")
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name}{labels} not exported"
    return float(found.group(1))


def _staging_whole(worker: Worker) -> None:
    used = "prefill_worker_vllm_staging_blocks_used"
    wait_until(lambda: _metric(worker, used) == 0, 10.0, "the staging region whole")


def test_vllm_pulls_transformers_kv_from_the_worker(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, checkpoint = served
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=n)
        params = _prefill(api, ids)
        assert params["remote_num_tokens"] == n and len(params["remote_block_ids"][0]) == -(
            -n // BLOCK
        )
        outcome = decode.pull_and_wait(f"dec-{n}", params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"dec-{n}", tmp_path / f"{n}.npz")
        _, hf_kv = hf_reference(checkpoint, ids)
        for layer, (k_ref, v_ref) in enumerate(hf_kv):
            raw = pulled[f"model.layers.{layer}.self_attn.attn"]  # [blocks, H, 32, 2D] bytes
            kv = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32))
            heads, dim = k_ref.shape[1], k_ref.shape[2]
            tokens = kv.transpose(1, 2).reshape(-1, heads, 2 * dim)[:n]
            torch.testing.assert_close(tokens[..., :dim], k_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(tokens[..., dim:], v_ref, atol=1e-4, rtol=0)
    _staging_whole(worker)


def test_a_prefix_hit_notifies_and_a_waiting_request_heartbeats(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess
) -> None:
    worker = served[0]
    expired = _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}')
    hit = _prefill(served[1], prompt(40, seed=7))
    decode.call("pull", request_id="dec-hit", params=hit, num_local=0)
    assert decode.call("wait", request_id="dec-hit", deadline_s=30)["load_errors"] == []
    _staging_whole(worker)  # released by the notification alone
    held = _prefill(served[1], prompt(40, seed=8))
    decode.call("hold", request_id="dec-held", params=held, interval_s=LEASE_S / 6)
    heartbeats = _metric(worker, "prefill_worker_vllm_heartbeats_total")
    wait_until(
        lambda: _metric(worker, "prefill_worker_vllm_heartbeats_total") >= heartbeats + 8,
        30.0,
        "heartbeats past the lease",
    )  # 8 heartbeats at lease / 6: the hold outlived its first lease
    decode.call("release", request_id="dec-held")
    outcome = decode.pull_and_wait("dec-held", held)
    assert outcome["finished"] and outcome["load_errors"] == [], outcome
    _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}') == expired
