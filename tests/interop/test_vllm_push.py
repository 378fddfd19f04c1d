"""vLLM's push mode against the real worker: vLLM's own ``NixlPushConnector`` worker half of
each version (0.33 and 0.34) as the decode, on the CPU, serving its own side channel with
vLLM's listener. A proxy-shaped client sends the worker a prefill with ``transfer_mode``
"push" and an ``X-Request-Id`` (as vLLM's proxy does), then gives the decode the answer's
``kv_transfer_params`` under the request id vLLM's engine would give it
(``cmpl-<X-Request-Id>-0-<8 hex>``); the decode sends its ``PUSH_REG`` to the worker's push
side channel's agent, and the worker WRITEs the staged KV into the decode's blocks. Checked:
transformers' K/V (fp32, 1e-4) for 1, 31, 32, 33 and 300 tokens, byte-exact against the
worker's own pool, every token staged by the forward; a prompt that hits the worker's prefix
cache mid-block; 8 requests at once; a decode that registers before the prefill answers; a
decode that had the first blocks cached (our last blocks land in its fewer blocks); a pull
answer of a pull-only worker given to a push decode refused by vLLM's hash (it covers the
mode), that worker refusing a push request 400; a push decode of TP 2 (vLLM's heterogeneous
TP: two processes of the connector, a KV head each, one side channel) getting each rank its
head; the staging region and the pool whole after each. One worker for the module (both
versions, both modes), one push decode per version."""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefill_worker.testing.launch import free_port
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.test_vllm_worker import (
    BLOCK,
    PAGE,
    PROXY_ASK,
    _assert_transformers_kv,
    _in_pool,
    _metric,
    _pool,
    _staged,
    _staging_whole,
    _start,
)
from tests.interop.vllm_decode import (
    FILL_BYTE,
    VLLM_PUSH_VERSIONS,
    VLLM_VERSIONS,
    VllmDecodeProcess,
    vllm_pythonpath,
)
from tests.polling import wait_until

pytestmark = pytest.mark.interop

MODES = 'transfer.vllm_transfer_modes=["pull","push"]'


@pytest.fixture(scope="module")
def pushed(
    tmp_path_factory: pytest.TempPathFactory, vllm_checkpoint: Path
) -> Iterator[tuple[Worker, str, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-push-worker")
    worker, api = _start(tmp, vllm_checkpoint, vllm_checkpoint, MODES)
    try:
        worker.child.wait_ready(120)
        yield worker, api, vllm_checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(params=VLLM_PUSH_VERSIONS)
def decode(vllm_push_decodes: dict[str, VllmDecodeProcess], request: Any) -> VllmDecodeProcess:
    return push_decode(vllm_push_decodes, request.param)


def push_decode(decodes: dict[str, VllmDecodeProcess], version: str) -> VllmDecodeProcess:
    """The session's push decode of ``version``, up (or the test skipped: not installed)."""
    process = decodes.get(version)
    if process is None:
        pytest.skip(f"vLLM {version} not installed")
    assert process.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"
    return process


def _seed(decode: VllmDecodeProcess, seed: int) -> int:
    return 5000 + seed + 1000 * VLLM_VERSIONS.index(decode.version)


def _post(
    api: str, ids: list[int], version: str, mode: str = "push"
) -> tuple[int, dict[str, Any], str]:
    """The prefill as vLLM's proxy sends it (with an X-Request-Id) -> status, body, the
    request id vLLM's engine gives the decode's copy of it."""
    external = secrets.token_hex(8)
    ask = {**PROXY_ASK, "vllm_version": version, "transfer_mode": mode}
    body = {"prompt": ids, "max_tokens": 1, "stream": False, "kv_transfer_params": ask}
    headers = {"Content-Type": "application/json", "X-Request-Id": external}
    request = urllib.request.Request(f"{api}/v1/completions", json.dumps(body).encode(), headers)
    decode_id = f"cmpl-{external}-0-{secrets.token_hex(4)}"
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(json.loads(response.read())), decode_id
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.loads(exc.read())), decode_id


def _prefill(api: str, ids: list[int], version: str) -> tuple[dict[str, Any], str]:
    status, answer, decode_id = _post(api, ids, version)
    assert status == 200, answer
    params = dict(answer["kv_transfer_params"])
    assert params["transfer_mode"] == "push"
    return params, decode_id


def _pushed_ok(outcome: dict[str, Any]) -> None:
    assert outcome["finished"] and outcome["load_errors"] == [], outcome


def test_vllm_push_lands_transformers_kv(
    pushed: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, checkpoint = pushed
    staged = _staged(worker)
    written = _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}')
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=_seed(decode, n))
        params, rid = _prefill(api, ids, decode.version)
        _pushed_ok(decode.push_and_wait(rid, params))
        landed = decode.blocks(rid, tmp_path / f"{n}.npz")
        pool_k, pool_v = _pool(worker)
        for layer, tokens in enumerate(
            _assert_transformers_kv(landed, hf_reference(checkpoint, ids)[1], n)
        ):
            dim = tokens.shape[-1] // 2
            assert _in_pool(pool_k[layer], tokens[..., :dim], PAGE), f"K {n} layer {layer}"
            assert _in_pool(pool_v[layer], tokens[..., dim:], PAGE), f"V {n} layer {layer}"
        assert _staged(worker) == (staged[0] + n, staged[1])  # the forward wrote every token
        staged = _staged(worker)
    _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}') == written + 5


def test_a_prefix_hit_mid_block_and_eight_at_once_are_pushed_exactly(
    pushed: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """100 tokens from the worker's prefix cache (repacked), 40 computed (mirrored), the
    fourth block from both; then 8 prefills in flight together and 8 pushes together."""
    worker, api, checkpoint = pushed
    base = prompt(200, seed=_seed(decode, 21))
    params, rid = _prefill(api, base, decode.version)
    _pushed_ok(decode.push_and_wait(rid, params))
    ids = base[:100] + prompt(40, seed=_seed(decode, 22))
    before = _staged(worker)
    params, rid = _prefill(api, ids, decode.version)
    _pushed_ok(decode.push_and_wait(rid, params))
    assert _staged(worker) == (before[0] + 40, before[1] + 100)
    _assert_transformers_kv(
        decode.blocks(rid, tmp_path / "hit.npz"), hf_reference(checkpoint, ids)[1], 140
    )
    prompts = [prompt(20 + 7 * i, seed=_seed(decode, 40 + i)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _prefill(api, p, decode.version), prompts))
    for params, rid in answers:
        decode.call("push", request_id=rid, params=params)
    for (_, rid), ids in zip(answers, prompts, strict=True):
        _pushed_ok(decode.call("wait", timeout_s=90, request_id=rid, deadline_s=60))
        landed = decode.blocks(rid, tmp_path / f"{rid}.npz")
        _assert_transformers_kv(landed, hf_reference(checkpoint, ids)[1], len(ids))
    _staging_whole(worker)


def test_a_decode_may_register_first_or_have_a_prefix_cached(
    pushed: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """A registration before the prefill's answer waits for it; a decode that had the first
    two of four blocks cached registers two, and gets our last two."""
    worker, api, checkpoint = pushed
    ids = prompt(100, seed=_seed(decode, 31))
    warm, warm_id = _prefill(api, prompt(8, seed=_seed(decode, 30)), decode.version)
    _pushed_ok(decode.push_and_wait(warm_id, warm))
    external = secrets.token_hex(8)
    rid = f"cmpl-{external}-0-{secrets.token_hex(4)}"
    decode.call("push", request_id=rid, params={**warm, "remote_num_tokens": 100})
    ask = {**PROXY_ASK, "vllm_version": decode.version, "transfer_mode": "push"}
    body = {"prompt": ids, "max_tokens": 1, "kv_transfer_params": ask}
    headers = {"Content-Type": "application/json", "X-Request-Id": external}
    request = urllib.request.Request(f"{api}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    _pushed_ok(decode.call("wait", timeout_s=90, request_id=rid, deadline_s=60))
    hf_kv = hf_reference(checkpoint, ids)[1]
    _assert_transformers_kv(decode.blocks(rid, tmp_path / "early.npz"), hf_kv, 100)
    ids = prompt(100, seed=_seed(decode, 32))
    params, rid = _prefill(api, ids, decode.version)
    decode.call("push", request_id=rid, params=params, num_local=2)
    _pushed_ok(decode.call("wait", timeout_s=90, request_id=rid, deadline_s=60))
    landed = decode.blocks(rid, tmp_path / "tail.npz")  # blocks 2 and 3 of the prompt
    hf_kv = hf_reference(checkpoint, ids)[1]
    tail = [(k[2 * BLOCK :], v[2 * BLOCK :]) for k, v in hf_kv]
    _assert_transformers_kv(landed, tail, 100 - 2 * BLOCK)
    _staging_whole(worker)


def test_a_pull_only_worker_refuses_push_and_a_push_decode_refuses_its_hash(
    pushed: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """A worker serving pull only refuses a push request at once (400, naming the modes it
    serves); its pull answer given to a push decode is refused by vLLM's hash check (the
    hash covers ``transfer_mode``): the decode's request fails, its blocks untouched, and
    the worker's hold ends at its lease, staging whole. Once (the newest version): the
    worker's side does not depend on it, and a worker start is the cost."""
    if decode.version != VLLM_VERSIONS[-1]:
        pytest.skip("run for the newest vLLM version only")
    worker, api = _start(tmp_path, pushed[2], pushed[2])
    try:
        worker.child.wait_ready(120)
        status, answer, _ = _post(api, prompt(8, seed=1), decode.version)
        assert status == 400 and "this worker serves pull" in json.dumps(answer), answer
        status, answer, rid = _post(api, prompt(40, seed=_seed(decode, 50)), decode.version, "pull")
        assert status == 200 and answer["kv_transfer_params"]["transfer_mode"] == "pull"
        outcome = decode.push_and_wait(rid, answer["kv_transfer_params"])
        assert outcome["finished"], outcome  # failed: vLLM reports it done, with nothing landed
        raw = decode.blocks(rid, tmp_path / "refused.npz")["model.layers.0.self_attn.attn"]
        assert np.all(raw == FILL_BYTE)
        expired = '{outcome="expired"}'
        wait_until(
            lambda: _metric(worker, "prefill_worker_vllm_holds_total", expired) == 1,
            30,
            "the refused hold's lease",
        )
        _staging_whole(worker)
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(scope="module")
def push_decode_tp2(vllm_checkpoint: Path) -> Iterator[list[VllmDecodeProcess]]:
    """vLLM's NixlPushConnector of the newest push version as a decode of TP 2: two
    processes in one gloo group, a KV head each, both naming one side channel that rank 0
    serves with both ranks' handshake payloads (what vLLM's scheduler-side listener serves)."""
    version = VLLM_PUSH_VERSIONS[-1]
    vllm_pythonpath(version)  # skip before starting anything
    dist_port, side_channel = free_port(), free_port()
    ranks = [
        VllmDecodeProcess(
            vllm_checkpoint,
            vllm_checkpoint.parent / f"push-decode-tp2-{version}-rank{rank}.log",
            num_blocks=32,
            engine_id=f"vllm-push-decode-tp2-{version}",
            version=version,
            tp=(rank, 2, dist_port),
            transfer_mode="push",
            side_channel_port=side_channel,
        )
        for rank in range(2)
    ]
    try:
        payloads = [decode.call("meta", timeout_s=300)["payload"] for decode in ranks]
        ranks[0].call("serve", payloads=payloads)
        yield ranks
    finally:
        for decode in ranks:
            decode.close()


def test_a_push_decode_of_tp_2_gets_each_rank_its_head(
    pushed: tuple[Worker, str, Path], push_decode_tp2: list[VllmDecodeProcess], tmp_path: Path
) -> None:
    """Both decode ranks register the request (``decode_tp_size`` 2); the worker (TP 1)
    handshakes both ranks and WRITEs each its head of every block ("<id>:1" to each): rank r
    holds head r of transformers' K/V, byte-exact against the worker's pool; one push per
    request, the second rank's registration not counted as ignored."""
    worker, api, checkpoint = pushed
    version = push_decode_tp2[0].version
    written = _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}')
    ignored = _ignored(worker)
    for n in (1, 33, 300):
        ids = prompt(n, seed=7000 + n)
        params, rid = _prefill(api, ids, version)
        for decode in push_decode_tp2:
            decode.call("push", request_id=rid, params=params)
        heads = []
        for rank, decode in enumerate(push_decode_tp2):
            outcome = decode.call("wait", timeout_s=90, request_id=rid, deadline_s=60)
            assert outcome["finished"] and outcome["load_errors"] == [], (rank, outcome)
            landed = decode.blocks(rid, tmp_path / f"tp2-{n}-{rank}.npz")
            assert all(raw.shape[1] == 1 for raw in landed.values())  # one head a rank
            heads.append(landed)
        both = {name: np.concatenate([h[name] for h in heads], axis=1) for name in heads[0]}
        pool_k, pool_v = _pool(worker)
        for layer, tokens in enumerate(
            _assert_transformers_kv(both, hf_reference(checkpoint, ids)[1], n)
        ):
            dim = tokens.shape[-1] // 2
            assert _in_pool(pool_k[layer], tokens[..., :dim], PAGE), f"K {n} layer {layer}"
            assert _in_pool(pool_v[layer], tokens[..., dim:], PAGE), f"V {n} layer {layer}"
        _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}') == written + 3
    assert _ignored(worker) == ignored


def _ignored(worker: Worker) -> float:
    """Every registration the worker ignored so far, whatever why."""
    _, text = worker.http("/metrics")
    name = "prefill_worker_vllm_push_registrations_ignored_total{"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
