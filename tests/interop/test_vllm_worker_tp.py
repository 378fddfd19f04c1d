"""vLLM's own NixlConnector of each version (``vllm_decode``: 0.33 and 0.34) pulling from a
real worker at TP 2 (``parallel.tp_size=2``, ``transfer.protocol: vllm``): both ranks'
forwards write their KV head into the staging region the group shares, the leader's agent
serves it as one vLLM prefill rank, and vLLM pulls transformers' K/V (fp32, 1e-4) for
prompts of 1, 31, 32, 33 and 300 tokens, each head byte-exact against the pool of the rank
that computed it (each rank dumps its own pool on SIGUSR2); 8 requests prefilled at once,
then pulled at once, each exact; a decode of TP 2 (two vLLM processes, a head each) reads
each rank's head and its two notifications end the hold; every staging block back after.
A prompt that hits the worker's prefix cache mid-block is repacked by every rank (its own
heads) and the rest mirrored, pulled exactly. vLLM's push decode of each version
(``conftest.vllm_push_decodes``) gets the same prompts WRITten, both heads exact. The
worker runs with optimistic prefill off (the chunks are the same whatever the timing, as in
the other TP interop tests)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.testing.launch import free_port
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.test_vllm_push import _prefill as push_prefill
from tests.interop.test_vllm_push import push_decode
from tests.interop.test_vllm_worker import (
    BLOCK,
    PAGE,
    _assert_transformers_kv,
    _in_pool,
    _metric,
    _prefill,
    _staged,
    _staging_whole,
    _start,
)
from tests.interop.vllm_decode import (
    VLLM_PUSH_VERSIONS,
    VLLM_VERSIONS,
    VllmDecodeProcess,
    vllm_pythonpath,
)
from tests.polling import wait_until

pytestmark = pytest.mark.interop

TP = 2  # the checkpoint's 2 KV heads: one per rank


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, vllm_checkpoint: Path
) -> Iterator[tuple[Worker, str, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-worker-tp")
    worker, api = _start(
        tmp,
        vllm_checkpoint,
        vllm_checkpoint,
        "transfer.protocol=vllm",
        f"parallel.tp_size={TP}",
        "scheduler.optimistic_prefill=false",
        'transfer.vllm_transfer_modes=["pull","push"]',  # for the push test below
    )
    try:
        worker.child.wait_ready(180)
        yield worker, api, vllm_checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def _seed(decode: VllmDecodeProcess, seed: int) -> int:
    return 5000 + seed + 1000 * VLLM_VERSIONS.index(decode.version)


def _rank_pids(worker: Worker) -> list[int]:
    """The leader's pid, then its followers' (the rank processes it started), rank order."""
    leader = worker.child.popen.pid
    children = Path(f"/proc/{leader}/task/{leader}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--rank" in argv:
            ranks[int(argv[argv.index(b"--rank") + 1])] = pid
    assert sorted(ranks) == list(range(1, TP)), children
    return [leader, *(ranks[r] for r in range(1, TP))]


def _pools(worker: Worker) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Each rank's whole pool now (its own head), per layer ``[pages, page_size * dim]``."""
    dump_dir = worker.child.log_path.parent
    pools = []
    for rank, pid in enumerate(_rank_pids(worker)):
        dump = dump_dir / f"rank{rank}.pt"
        dump.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
        wait_until(dump.exists, 30.0, f"rank {rank}'s pool dump")
        pool = torch.load(dump)
        k, v = (
            [t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in pool[kv]]
            for kv in ("k", "v")
        )
        pools.append((k, v))
    return pools


def test_vllm_pulls_every_rank_s_heads_from_a_tp_worker(
    served: tuple[Worker, str, Path], vllm_decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, checkpoint = served
    decode = vllm_decode
    staged = _staged(worker)
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=_seed(decode, n))
        params = _prefill(api, ids, decode.version)
        assert params["tp_size"] == 1, params  # one prefill rank holding every head
        assert len(params["remote_block_ids"][0]) == -(-n // BLOCK)
        outcome = decode.pull_and_wait(f"tp-{n}", params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"tp-{n}", tmp_path / f"{n}.npz")
        pools = _pools(worker)  # before the next prompt may reuse its pages
        _, hf_kv = hf_reference(checkpoint, ids)
        for layer, tokens in enumerate(_assert_transformers_kv(pulled, hf_kv, n)):
            dim = tokens.shape[-1] // 2
            for rank, (pool_k, pool_v) in enumerate(pools):
                head = tokens[:, rank : rank + 1]  # rank r computed head r
                where = f"{n} tokens, layer {layer}, rank {rank}"
                assert _in_pool(pool_k[layer], head[..., :dim], PAGE), f"K {where}"
                assert _in_pool(pool_v[layer], head[..., dim:], PAGE), f"V {where}"
        assert _staged(worker) == (staged[0] + n, staged[1])  # every token by the forwards
        staged = _staged(worker)
    _staging_whole(worker)


@pytest.mark.parametrize("version", VLLM_PUSH_VERSIONS)
def test_vllm_push_writes_every_rank_s_heads_from_a_tp_worker(
    served: tuple[Worker, str, Path],
    vllm_push_decodes: dict[str, VllmDecodeProcess],
    version: str,
    tmp_path: Path,
) -> None:
    """vLLM's push decode (``test_vllm_push``) against the TP-2 worker: the WRITE of the
    shared staging region carries both ranks' heads, transformers' K/V for each prompt, a
    prompt that hits the prefix cache mid-block too (repacked by both ranks)."""
    worker, api, checkpoint = served
    decode = push_decode(vllm_push_decodes, version)
    written = _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}')
    base = prompt(200, seed=_seed(decode, 61))
    for n, ids in [(n, prompt(n, seed=_seed(decode, 60 + n))) for n in (1, 31, 32, 33, 300)] + [
        (140, base[:100] + prompt(40, seed=_seed(decode, 62)))
    ]:
        if n == 140:  # base's first 100 tokens in the prefix cache, then the hit
            params, rid = push_prefill(api, base, version)
            assert decode.push_and_wait(rid, params)["load_errors"] == []
        params, rid = push_prefill(api, ids, version)
        outcome = decode.push_and_wait(rid, params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        landed = decode.blocks(rid, tmp_path / f"push-{n}.npz")
        _assert_transformers_kv(landed, hf_reference(checkpoint, ids)[1], n)
    assert _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}') == written + 7
    _staging_whole(worker)


def test_a_prefix_hit_is_repacked_by_every_rank(
    served: tuple[Worker, str, Path], vllm_decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """100 cached tokens (three blocks and 4 tokens of the fourth) repacked by both ranks,
    each its head (the leader on its repack thread, the follower from a step's stage), the
    40 computed ones mirrored by both forwards: vLLM reads all of them exactly."""
    worker, api, checkpoint = served
    decode = vllm_decode
    base = prompt(200, seed=_seed(decode, 21))
    first = _prefill(api, base, decode.version)
    decode.call("pull", request_id="tp-base", params=first, num_local=0)  # releases it
    assert decode.call("wait", request_id="tp-base", deadline_s=30)["load_errors"] == []
    ids = base[:100] + prompt(40, seed=_seed(decode, 22))
    before = _staged(worker)
    outcome = decode.pull_and_wait("tp-hit-100", _prefill(api, ids, decode.version))
    assert outcome["finished"] and outcome["load_errors"] == [], outcome
    assert _staged(worker) == (before[0] + 40, before[1] + 100)
    pulled = decode.blocks("tp-hit-100", tmp_path / "hit.npz")
    _assert_transformers_kv(pulled, hf_reference(checkpoint, ids)[1], len(ids))
    _staging_whole(worker)


def test_eight_requests_at_once_from_a_tp_worker(
    served: tuple[Worker, str, Path], vllm_decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, checkpoint = served
    decode = vllm_decode
    prompts = [prompt(20 + 7 * i, seed=_seed(decode, 40 + i)) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda ids: _prefill(api, ids, decode.version), prompts))
    assert len({a["remote_request_id"] for a in answers}) == 8
    for i, params in enumerate(answers):
        decode.call("pull", request_id=f"tp-many-{i}", params=params)
    for i, ids in enumerate(prompts):
        outcome = decode.call("wait", timeout_s=90, request_id=f"tp-many-{i}", deadline_s=60)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"tp-many-{i}", tmp_path / f"many-{i}.npz")
        _assert_transformers_kv(pulled, hf_reference(checkpoint, ids)[1], len(ids))
    _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}') == 0


@pytest.fixture(scope="module", params=VLLM_VERSIONS)
def decode_tp2(
    vllm_checkpoint: Path, request: pytest.FixtureRequest
) -> Iterator[list[VllmDecodeProcess]]:
    """vLLM's connector as a decode of TP 2: two processes, one gloo group, one KV head each."""
    version = request.param
    vllm_pythonpath(version)  # skip before starting anything
    port = free_port()
    ranks = [
        VllmDecodeProcess(
            vllm_checkpoint,
            vllm_checkpoint.parent / f"decode-tp2-{version}-rank{rank}.log",
            num_blocks=64,
            engine_id=f"vllm-decode-tp2-{version}",
            version=version,
            tp=(rank, 2, port),
        )
        for rank in range(2)
    ]
    try:
        for decode in ranks:
            assert decode.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"
        yield ranks
    finally:
        for decode in ranks:
            decode.close()


def test_a_decode_of_tp_2_pulls_each_rank_s_head(
    served: tuple[Worker, str, Path], decode_tp2: list[VllmDecodeProcess], tmp_path: Path
) -> None:
    """Each decode rank reads its head of every block (vLLM's decode TP > prefill TP path:
    ``tp_size`` 1 in the answer) and notifies with 2 consumers: the hold ends once both read."""
    worker, api, checkpoint = served
    version = decode_tp2[0].version
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=_seed(decode_tp2[0], 100 + n))
        params = _prefill(api, ids, version)
        for decode in decode_tp2:
            decode.call("pull", request_id=f"tp2-{n}", params=params)
        heads = []
        for rank, decode in enumerate(decode_tp2):
            outcome = decode.call("wait", timeout_s=90, request_id=f"tp2-{n}", deadline_s=60)
            assert outcome["finished"] and outcome["load_errors"] == [], (rank, outcome)
            heads.append(decode.blocks(f"tp2-{n}", tmp_path / f"tp2-{n}-{rank}.npz"))
        pulled = {
            name: np.concatenate([h[name] for h in heads], axis=1)  # [blocks, 2 heads, ...]
            for name in heads[0]
        }
        _assert_transformers_kv(pulled, hf_reference(checkpoint, ids)[1], n)
        _staging_whole(worker)  # both ranks' notifications: released, not expired
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="expired"}') == 0
