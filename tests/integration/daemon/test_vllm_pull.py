"""vLLM decodes pulling from the real worker process (``transfer.protocol: native,vllm``,
the HTTP front on): a proxy-shaped client sends what vLLM's proxy and llm-d's sidecar send,
carries the answer's ``kv_transfer_params`` to a vLLM-shaped decode (tests/integration/vllm/
decode.py: the side channel's handshake, then NIXL READs with vLLM's notifications), which
gets transformers' K/V for every prompt length around vLLM's 32-token block over 4-token
pages; a decode that never reads frees its blocks at the lease, a heartbeat keeps a hold past
it, and the staging region is whole at the end (its metrics say so). Every prompt here is
staged by the forward itself (the KV mirror: no prefix hit, claimed before its prefill).

One worker for the module (start-ups are the cost here)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefill_worker.transfer.vllm.handshake import CompatFactors, compat_hash
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Worker, free_port, start_worker, wait_until
from tests.integration.daemon.test_daemon import hf_reference
from tests.integration.vllm.decode import PullDecode, handshake
from tests.patience import patient

MODEL = "tiny-llama"
BLOCK = 32
LEASE_S = 3.0
PROXY_ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def pulled(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[tuple[Worker, str, PullDecode]]:
    api_port, side_port = free_port(), free_port(2)  # a side channel per vLLM version
    worker = start_worker(
        tmp_path_factory.mktemp("vllm-worker"),
        checkpoint,
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{api_port}",
        f"http_api.served_model_name={MODEL}",
        "transfer.protocol=native,vllm",
        f"transfer.vllm_side_channel_port={side_port}",
        f"transfer.vllm_block_size={BLOCK}",
        "transfer.vllm_staging_blocks=24",
        f"transfer.vllm_lease_s={LEASE_S}",
        "transfer.vllm_read_grace_s=0.5",
        "transfer.vllm_attention_backend=CPU_ATTN",
    )
    try:
        worker.child.wait_ready(120)
        config = json.loads((checkpoint / "config.json").read_text())
        factors = CompatFactors(
            MODEL,
            "float32",
            config["num_key_value_heads"],
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            config["num_hidden_layers"],
            attn_backend_name="CPU_ATTN",
        )
        hash_, meta = handshake("127.0.0.1", side_port)
        assert hash_ == compat_hash(factors)
        decode = PullDecode(meta)
        yield worker, f"http://127.0.0.1:{api_port}", decode
        decode.close()
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def _prefill(api: str, ids: list[int]) -> dict[str, Any]:
    """The proxy's prefill request; the answer (200 asserted)."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "stream": False}
    body["kv_transfer_params"] = PROXY_ASK
    request = urllib.request.Request(
        f"{api}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=patient(60)) as response:
        assert response.status == 200
        return dict(json.loads(response.read()))


def _metric(worker: Worker, name: str, labels: str = "") -> float:
    _, text = worker.http("/metrics")
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name}{labels} not exported"
    return float(found.group(1))


def _staged_tokens(worker: Worker, how: str) -> float:
    return _metric(worker, "prefill_worker_vllm_staged_tokens_total", f'{{how="{how}"}}')


def _staging_used(worker: Worker) -> float:
    return _metric(worker, "prefill_worker_vllm_staging_blocks_used")


@pytest.mark.parametrize("n", [1, 31, 32, 33, 300])
def test_a_vllm_decode_pulls_transformers_kv(
    pulled: tuple[Worker, str, PullDecode], checkpoint: Path, n: int
) -> None:
    worker, api, decode = pulled
    ids = prompt(n, seed=n)
    _, hf_kv = hf_reference(checkpoint, ids)  # the first token: the decode samples its own
    staged = [_staged_tokens(worker, how) for how in ("mirror", "repack")]
    answer = _prefill(api, ids)  # its blocks are held for LEASE_S: read them at once
    params = answer["kv_transfer_params"]
    assert answer["usage"]["prompt_tokens"] == n
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "pull"
    assert params["remote_num_tokens"] == n and params["tp_size"] == 1
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == -(-n // BLOCK)
    raw = decode.read(blocks, f"{params['remote_request_id']}:1")
    heads, head_dim = hf_kv[0][0].shape[1:]
    lbhnc = raw.view(np.float32).reshape(len(hf_kv), len(blocks), heads, BLOCK, 2 * head_dim)
    tokens = torch.from_numpy(lbhnc).transpose(2, 3).reshape(len(hf_kv), -1, heads, 2 * head_dim)
    for layer, (k_ref, v_ref) in enumerate(hf_kv):
        torch.testing.assert_close(tokens[layer, :n, :, :head_dim], k_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(tokens[layer, :n, :, head_dim:], v_ref, atol=1e-4, rtol=0)
    wait_until(lambda: _staging_used(worker) == 0, 10.0, "the read's release")
    assert [_staged_tokens(worker, how) for how in ("mirror", "repack")] == [
        staged[0] + n,
        staged[1],
    ]


def test_notification_only_lease_and_heartbeat(pulled: tuple[Worker, str, PullDecode]) -> None:
    worker, api, decode = pulled
    reads = _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="read"}')
    expired = _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}')
    hit = _prefill(api, prompt(40, seed=1))["kv_transfer_params"]
    decode.notify(f"{hit['remote_request_id']}:1")  # a full prefix hit on the decode
    wait_until(lambda: _staging_used(worker) == 0, 10.0, "the notification's release")
    never = _prefill(api, prompt(40, seed=2))["kv_transfer_params"]
    kept = _prefill(api, prompt(40, seed=3))["kv_transfer_params"]

    def expired_now() -> float:
        return _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}')

    # The decode heartbeats `kept` (at its cadence, lease / 6) for as long as the test looks,
    # so `kept` never runs out however slow this machine is, until `kept` has outlived its own
    # first lease and `never`'s lease and read grace have passed: one expiry, and only
    # `kept`'s two blocks staged.
    outlived = time.monotonic() + LEASE_S + 1.0
    deadline = outlived + 30.0
    while not (
        time.monotonic() > outlived and expired_now() == expired + 1 and _staging_used(worker) == 2
    ):
        assert expired_now() <= expired + 1, "a heartbeated hold expired"
        assert time.monotonic() < deadline, "`never`'s lease never ended"
        decode.notify(f"HB:{kept['remote_request_id']}")
        time.sleep(LEASE_S / 6)
    decode.read(kept["remote_block_ids"][0], f"{kept['remote_request_id']}:1")
    wait_until(lambda: _staging_used(worker) == 0, 10.0, "the read's release")
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="read"}') == reads + 2
    assert never["remote_request_id"] != kept["remote_request_id"]
