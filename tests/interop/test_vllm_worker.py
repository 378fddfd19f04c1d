"""vLLM's own NixlConnector of each version (``vllm_decode``: 0.33 and 0.34) pulling from the
real worker process (``transfer.protocol: native,vllm``, serving both versions at once, each
on its own side channel) over the HTTP path: a proxy-shaped client sends the worker what
vLLM's proxy sends (with ``vllm_version``, the decode's), carries the answer's
``kv_transfer_params`` to the decode process, and vLLM pulls transformers' K/V (fp32, 1e-4)
for prompts around its 32-token block over the worker's 4-token pages, with no load errors,
byte-exact against the worker's own pool (dumped on SIGUSR2 by ``testing.tp_ranks
--dump-on-signal``), every token staged by the forward (the KV mirror); 8 requests at once,
each exact; a prompt that hits the worker's prefix cache mid-block (the hit repacked, the
rest mirrored into the same block) pulled exactly too; a full local prefix hit only
notifies; a request that waits in vLLM's queue heartbeats its hold past the worker's lease;
a worker of another model (head size 16, not the decode's 32), or one serving only the other
vLLM version, is refused by vLLM's hash check (a load error on the decode; on the worker the
hold ends at its lease, counted, its staging whole), and that worker refuses a request
naming the decode's version with 400; every staging block comes back (the worker's
metrics). One worker for the module; the decodes are the session's
(``conftest.vllm_decode``). Prompts are seeded per version: the worker's prefix cache
outlives one version's tests."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import Worker, free_port, start_worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.vllm_decode import VLLM_VERSIONS, VllmDecodeProcess
from tests.polling import wait_until

pytestmark = pytest.mark.interop

BLOCK = 32
PAGE = 4  # configs/tiny-test.yaml's cache.page_size
# A held request's lease, and how often vLLM's decode heartbeats it here: a hold survives
# any pause of the decode (or of the worker) under LEASE_S - HEARTBEAT_S, on a loaded machine.
LEASE_S = 8.0
HEARTBEAT_S = 0.5
DUMP_MODULE = "prefill_worker.testing.tp_ranks"  # TP 1 here: only its pool dump
PROXY_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


def _start(tmp: Path, checkpoint: Path, decode_model: Path, *settings: str) -> tuple[Worker, str]:
    """A worker serving native and vLLM on ``checkpoint`` for decodes of ``decode_model``
    (their hash covers it), its pool dumped on SIGUSR2 to ``tmp/rank0.pt``; not waited for."""
    api_port = free_port()
    worker = start_worker(
        tmp,
        checkpoint,
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{api_port}",
        "transfer.protocol=native,vllm",
        f"transfer.vllm_side_channel_port={free_port(2)}",  # a side channel per version
        f"transfer.vllm_block_size={BLOCK}",
        "transfer.vllm_staging_blocks=24",
        f"transfer.vllm_lease_s={LEASE_S}",
        "transfer.vllm_read_grace_s=0.5",
        f"transfer.vllm_model={decode_model}",
        "transfer.vllm_attention_backend=CPU_ATTN",
        *settings,
        module=DUMP_MODULE,
        module_args=["--dump-dir", str(tmp), "--dump-on-signal"],
    )
    return worker, f"http://127.0.0.1:{api_port}"


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, vllm_checkpoint: Path
) -> Iterator[tuple[Worker, str, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-worker")
    worker, api = _start(tmp, vllm_checkpoint, vllm_checkpoint)
    try:
        worker.child.wait_ready(120)
        yield worker, api, vllm_checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(scope="module")
def decode(vllm_decode: VllmDecodeProcess) -> VllmDecodeProcess:
    return vllm_decode


def _seed(decode: VllmDecodeProcess, seed: int) -> int:
    """A prompt seed of its own per version (the worker's prefix cache outlives a version's
    tests, and the prefix-hit test counts what it computes)."""
    return seed + 1000 * VLLM_VERSIONS.index(decode.version)


def _post(api: str, ids: list[int], version: str | None) -> tuple[int, dict[str, Any]]:
    ask = PROXY_ASK if version is None else {**PROXY_ASK, "vllm_version": version}
    body = {"prompt": ids, "max_tokens": 1, "stream": False, "kv_transfer_params": ask}
    request = urllib.request.Request(
        f"{api}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.loads(exc.read()))


def _prefill(api: str, ids: list[int], version: str | None) -> dict[str, Any]:
    """The answer's ``kv_transfer_params`` for a decode of ``version`` (None: name none)."""
    status, answer = _post(api, ids, version)
    assert status == 200, answer
    return dict(answer["kv_transfer_params"])


def _metric(worker: Worker, name: str, labels: str = "") -> float:
    _, text = worker.http("/metrics")
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name}{labels} not exported"
    return float(found.group(1))


def _assert_transformers_kv(pulled: Any, hf_kv: Any, n: int) -> list[torch.Tensor]:
    """vLLM's blocks hold transformers' K‖V of the ``n`` prompt tokens (fp32, 1e-4); each
    layer's tokens as ``[n, heads, 2 * dim]``."""
    layers = []
    for layer, (k_ref, v_ref) in enumerate(hf_kv):
        raw = pulled[f"model.layers.{layer}.self_attn.attn"]  # [blocks, H, 32, 2D] bytes
        kv = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32))
        heads, dim = k_ref.shape[1], k_ref.shape[2]
        tokens = kv.transpose(1, 2).reshape(-1, heads, 2 * dim)[:n]
        torch.testing.assert_close(tokens[..., :dim], k_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(tokens[..., dim:], v_ref, atol=1e-4, rtol=0)
        layers.append(tokens)
    return layers


def _staged(worker: Worker) -> tuple[float, float]:
    """Prompt tokens staged so far: by the forward (the KV mirror), by a repack."""
    name = "prefill_worker_vllm_staged_tokens_total"
    return _metric(worker, name, '{how="mirror"}'), _metric(worker, name, '{how="repack"}')


def _pool(worker: Worker) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The worker's whole pool now, per layer ``[pages, page_size * heads * dim]`` bytes."""
    dump = worker.child.log_path.parent / "rank0.pt"  # _start's dump dir
    dump.unlink(missing_ok=True)
    os.kill(worker.child.popen.pid, signal.SIGUSR2)
    wait_until(dump.exists, 30.0, "the worker's pool dump")
    pool = torch.load(dump)
    flat = [
        [t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in pool[kv]]
        for kv in ("k", "v")
    ]
    return flat[0], flat[1]


def _in_pool(pages: np.ndarray, tokens: torch.Tensor, page_size: int) -> bool:
    """Every page-sized run of ``tokens`` ([n, heads, dim]) equals the start of a pool page,
    byte for byte (a request's pages are anywhere in the pool, in any order)."""
    raw = tokens.contiguous().view(torch.uint8).reshape(tokens.shape[0], -1).numpy()
    for start in range(0, raw.shape[0], page_size):
        run = raw[start : start + page_size].reshape(-1)
        if not (pages[:, : run.size] == run).all(axis=1).any():
            return False
    return True


def _staging_whole(worker: Worker) -> None:
    """Every staging block back, and no pool page held by a request."""
    used = "prefill_worker_vllm_staging_blocks_used"
    wait_until(lambda: _metric(worker, used) == 0, 10.0, "the staging region whole")
    wait_until(lambda: _metric(worker, "prefill_worker_kv_pages_used") == 0, 10.0, "pool whole")


def test_vllm_pulls_transformers_kv_from_the_worker(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, checkpoint = served
    staged = _staged(worker)
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=_seed(decode, n))
        params = _prefill(api, ids, decode.version)
        assert params["remote_num_tokens"] == n and len(params["remote_block_ids"][0]) == -(
            -n // BLOCK
        )
        outcome = decode.pull_and_wait(f"dec-{n}", params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"dec-{n}", tmp_path / f"{n}.npz")
        pool_k, pool_v = _pool(worker)  # before the next prompt may reuse its pages
        _, hf_kv = hf_reference(checkpoint, ids)
        for layer, tokens in enumerate(_assert_transformers_kv(pulled, hf_kv, n)):
            dim = tokens.shape[-1] // 2
            assert _in_pool(pool_k[layer], tokens[..., :dim], PAGE), f"K {n} layer {layer}"
            assert _in_pool(pool_v[layer], tokens[..., dim:], PAGE), f"V {n} layer {layer}"
        assert _staged(worker) == (staged[0] + n, staged[1])  # the forward wrote every token
        staged = _staged(worker)
    _staging_whole(worker)


def test_eight_requests_at_once_are_each_pulled_exactly(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """8 prefills in flight together (the worker batches them), then 8 pulls in flight
    together on the decode: each request's blocks hold its own prompt's K/V."""
    worker, api, checkpoint = served
    prompts = [prompt(20 + 7 * i, seed=_seed(decode, 40 + i)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda ids: _prefill(api, ids, decode.version), prompts))
    assert len({a["remote_request_id"] for a in answers}) == 8
    for i, params in enumerate(answers):
        decode.call("pull", request_id=f"dec-many-{i}", params=params)
    for i, ids in enumerate(prompts):
        outcome = decode.call("wait", timeout_s=90, request_id=f"dec-many-{i}", deadline_s=60)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"dec-many-{i}", tmp_path / f"many-{i}.npz")
        _assert_transformers_kv(pulled, hf_reference(checkpoint, ids)[1], len(ids))
    _staging_whole(worker)


def test_a_worker_prefix_hit_is_repacked_and_the_rest_mirrored(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """100 cached tokens (three blocks and 4 tokens of the fourth) come from the repack, the
    40 computed ones from the forward, the fourth block from both: vLLM reads them exactly."""
    worker, api, checkpoint = served
    base = prompt(200, seed=_seed(decode, 21))
    first = _prefill(api, base, decode.version)
    decode.call("pull", request_id="dec-base", params=first, num_local=0)  # releases it
    assert decode.call("wait", request_id="dec-base", deadline_s=30)["load_errors"] == []
    ids = base[:100] + prompt(40, seed=_seed(decode, 22))
    before = _staged(worker)
    outcome = decode.pull_and_wait("dec-hit-100", _prefill(api, ids, decode.version))
    assert outcome["finished"] and outcome["load_errors"] == [], outcome
    assert _staged(worker) == (before[0] + 40, before[1] + 100)
    pulled = decode.blocks("dec-hit-100", tmp_path / "hit.npz")
    _assert_transformers_kv(pulled, hf_reference(checkpoint, ids)[1], len(ids))
    _staging_whole(worker)


def test_a_prefix_hit_notifies_and_a_waiting_request_heartbeats(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess
) -> None:
    worker = served[0]
    expired = _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}')
    hit = _prefill(served[1], prompt(40, seed=_seed(decode, 7)), decode.version)
    decode.call("pull", request_id="dec-hit", params=hit, num_local=0)
    assert decode.call("wait", request_id="dec-hit", deadline_s=30)["load_errors"] == []
    _staging_whole(worker)  # released by the notification alone
    held = _prefill(served[1], prompt(40, seed=_seed(decode, 8)), decode.version)
    decode.call("hold", request_id="dec-held", params=held, interval_s=HEARTBEAT_S)
    heartbeats = _metric(worker, "prefill_worker_vllm_heartbeats_total")
    past_lease = math.ceil(LEASE_S / HEARTBEAT_S) + 1  # the hold outlived its first lease
    wait_until(
        lambda: _metric(worker, "prefill_worker_vllm_heartbeats_total") >= heartbeats + past_lease,
        LEASE_S * 4,
        "heartbeats past the lease",
    )
    decode.call("release", request_id="dec-held")
    outcome = decode.pull_and_wait("dec-held", held)
    assert outcome["finished"] and outcome["load_errors"] == [], outcome
    _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}') == expired


def _assert_refused_by_the_hash(
    worker: Worker, api: str, decode: VllmDecodeProcess, version: str | None, seed: int
) -> None:
    """The decode's pull ends finished with every block a load error (vLLM's hash check
    refused the worker's handshake); on the worker the hold ends at its lease, staging whole."""
    params = _prefill(api, prompt(40, seed=_seed(decode, seed)), version)
    outcome = decode.pull_and_wait(f"dec-wrong-{seed}", params)
    assert outcome["finished"] and outcome["blocks"], outcome
    assert outcome["load_errors"] == sorted(outcome["blocks"]), outcome
    expired = '{outcome="expired"}'
    wait_until(
        lambda: _metric(worker, "prefill_worker_vllm_holds_total", expired) == 1,
        LEASE_S + 10,
        "the refused hold's lease",
    )
    _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="read"}') == 0


def test_a_worker_of_another_model_is_refused_by_the_hash(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """The llama checkpoint's head size is 16; the decode's model (qwen3) has 32."""
    other = make_checkpoint("llama", tmp_path / "llama")
    worker, api = _start(tmp_path, other, served[2])
    try:
        worker.child.wait_ready(120)
        _assert_refused_by_the_hash(worker, api, decode, decode.version, 9)
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def test_a_worker_of_the_other_version_is_refused_by_the_hash_and_refuses_this_one(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """A worker serving only the other vLLM version: its answer (no version named, so its
    one) is refused by this decode's hash check (vLLM's version is hashed); a request naming
    this decode's version is refused at once, 400, with the versions it serves."""
    (other,) = [v for v in VLLM_VERSIONS if v != decode.version]
    worker, api = _start(tmp_path, served[2], served[2], f'transfer.vllm_versions=["{other}"]')
    try:
        worker.child.wait_ready(120)
        status, answer = _post(api, prompt(8, seed=_seed(decode, 10)), decode.version)
        assert status == 400, answer
        assert f"vLLM {decode.version}: this worker serves vLLM {other}" in json.dumps(answer)
        _assert_refused_by_the_hash(worker, api, decode, None, 11)
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()
