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
(``conftest.vllm_push_decodes``) gets the same prompts WRITten, both heads exact, and a push
decode of TP 2 (opened beside the pull decode of TP 2) gets each rank its head.

The hybrids at worker TP 2, into vLLM 0.34 decodes of TP 1 (opened beside the session's
decode) and TP 2 (beside the module's): gpt-oss (each KV-cache group's blocks, a sliding
group's its window's) and Qwen3-Next (the prompt cut one token short; each decode rank's
share of every state page, byte for byte its worker rank's own share), checked by
``vllm_hybrid_checks``. The workers run with optimistic prefill off (the chunks are the same
whatever the timing, as in the other TP interop tests)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefill_worker.testing.launch import free_port
from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import Worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.test_vllm_linear import AUX_USED
from tests.interop.test_vllm_linear import _hf as gdn_reference
from tests.interop.test_vllm_push import _ignored, push_decode
from tests.interop.test_vllm_push import _prefill as push_prefill
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
    INTEROP_DIR,
    VLLM_PUSH_VERSIONS,
    VLLM_VERSIONS,
    OpenedDecode,
    VllmDecodeProcess,
    vllm_pythonpath,
)
from tests.interop.vllm_hybrid_checks import (
    assert_heads_in_pools,
    assert_state_in_ranks,
    assert_swa,
    kv_heads,
    open_ranks,
    pull,
    whole_state,
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


def _dumps(worker: Worker) -> list[dict[str, Any]]:
    """Each rank's dump now (``testing.tp_ranks``: its pool, a hybrid's state pool too)."""
    dump_dir = worker.child.log_path.parent
    dumps = []
    for rank, pid in enumerate(_rank_pids(worker)):
        dump = dump_dir / f"rank{rank}.pt"
        dump.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
        wait_until(dump.exists, 30.0, f"rank {rank}'s pool dump")
        dumps.append(torch.load(dump))
    return dumps


def _pools(
    worker: Worker, dumps: list[dict[str, Any]] | None = None
) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Each rank's whole pool now (its own head), per layer ``[pages, page_size * dim]``."""
    pools = []
    for pool in _dumps(worker) if dumps is None else dumps:
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


# -- hybrid models at worker TP 2, and a push decode of TP 2 --------------------------------

HYBRID = "0.34.0"  # the vLLM version whose decodes get a hybrid model's KV-cache groups
SWA_GROUPS = {0: 0, 2: 1, 1: 2}  # gpt-oss (sliding, full, sliding): [L0] [L2] [L1]
GDN_FULL, GDN_LINEAR = (1, 4), (0, 2, 3)  # Qwen3-Next: full and linear (GDN) layers
GDN = {  # tests/checkpoints.py's linear layers: 2 key heads of 12, 6 value heads of 10
    "key_dim": 24, "value_dim": 60, "num_v_heads": 6, "dk": 12, "dv": 10, "kernel": 4,
}  # fmt: skip


def _hybrid_worker(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> Iterator[tuple[Worker, str, Path]]:
    vllm_pythonpath(HYBRID)  # skip before building anything
    if family == "qwen3_next":
        env = INTEROP_DIR / f"vllm-{HYBRID}"
        if not ((env / "compressed_tensors").exists() and (env / "loguru").exists()):
            pytest.skip(f"{env} lacks compressed-tensors and loguru (vLLM's GDN model import)")
    tmp = tmp_path_factory.mktemp(f"vllm-tp-{family}")
    checkpoint = make_checkpoint(family, tmp / family)
    worker, api = _start(
        tmp,
        checkpoint,
        checkpoint,
        "transfer.protocol=vllm",
        f"parallel.tp_size={TP}",
        "scheduler.optimistic_prefill=false",
    )
    try:
        worker.child.wait_ready(180)
        yield worker, api, checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(scope="module")
def swa_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, str, Path]]:
    """gpt-oss (sliding, full, sliding; window 24) at worker TP 2: a KV head per rank."""
    yield from _hybrid_worker(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="module")
def gdn_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, str, Path]]:
    """Qwen3-Next (linear, full, linear, linear, full) at worker TP 2: a KV head, a key head
    and three value heads per rank; the leader gathers each prompt's state slot whole."""
    yield from _hybrid_worker(tmp_path_factory, "qwen3_next")


def _hybrid_decode(
    processes: list[VllmDecodeProcess], checkpoint: Path, kind: str
) -> list[OpenedDecode]:
    """A decode of the hybrid ``checkpoint`` beside each process's first (the same TP)."""
    if processes[0].version != HYBRID:
        pytest.skip(f"hybrid KV-cache groups: vLLM {HYBRID} decodes only")
    tp = len(processes)
    engine = f"vllm-{kind}-tp{tp}"
    return open_ranks(processes, engine, model_dir=str(checkpoint), engine_id=engine, num_blocks=64)


def _assert_swa_pulls(
    served: tuple[Worker, str, Path], ranks: list[OpenedDecode], tmp_path: Path
) -> None:
    worker, api, checkpoint = served
    for n in (33, 70):  # a sliding group's window: 2 blocks of 3
        ids = prompt(n, seed=800 + n + 10 * len(ranks))
        params = _prefill(api, ids, HYBRID)
        assert params["tp_size"] == 1, params  # one prefill rank holding every head
        sent = params["remote_block_ids"]
        landed = pull(ranks, f"swa-tp{len(ranks)}-{n}", params, tmp_path)
        assert all(raw.shape[1] == 2 // len(ranks) for raw in landed[0].values())
        assert_swa(landed, sent, SWA_GROUPS, hf_reference(checkpoint, ids)[1], _pools(worker), n)
        _staging_whole(worker)


def test_a_sliding_window_model_from_a_tp_worker_to_a_decode_of_tp_1(
    swa_served: tuple[Worker, str, Path], vllm_decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """gpt-oss at worker TP 2 into vLLM 0.34's decode of TP 1 (its KV-cache groups, a
    sliding group its window's blocks): both heads, each its rank's, transformers' K/V."""
    _assert_swa_pulls(swa_served, _hybrid_decode([vllm_decode], swa_served[2], "swa"), tmp_path)


def test_a_sliding_window_model_from_a_tp_worker_to_a_decode_of_tp_2(
    swa_served: tuple[Worker, str, Path], decode_tp2: list[VllmDecodeProcess], tmp_path: Path
) -> None:
    """The same into a decode of TP 2: decode rank r reads head r of every layer's blocks
    (vLLM's decode TP > prefill TP path, per KV-cache group), byte for byte worker rank r's."""
    _assert_swa_pulls(swa_served, _hybrid_decode(decode_tp2, swa_served[2], "swa"), tmp_path)


def _assert_gdn_pulls(
    served: tuple[Worker, str, Path], ranks: list[OpenedDecode], tmp_path: Path
) -> None:
    """vLLM's pull of a Qwen3-Next prompt cut one token short: each full layer's heads (its
    rank's, transformers'), each linear layer's state (the decode ranks' shares put back
    together: transformers' after ``ids[:-1]``, and byte for byte each worker rank's share
    of one state slot); every block, page and slot back."""
    worker, api, checkpoint = served
    for n in (2, 70):  # one token loaded; three blocks over several chunks
        ids = prompt(n, seed=900 + n + 10 * len(ranks))
        params = _prefill(api, ids, HYBRID)
        loaded = ids[:-1]
        assert params["remote_num_tokens"] == len(loaded) and params["tp_size"] == 1, params
        landed = pull(ranks, f"gdn-tp{len(ranks)}-{n}", params, tmp_path)
        dumps = _dumps(worker)
        pools = _pools(worker, dumps)
        hf_kv, hf_state = gdn_reference(checkpoint, loaded)
        for position, layer in enumerate(GDN_FULL):
            k_ref, v_ref = hf_kv[layer]
            dim = k_ref.shape[2]
            tokens = kv_heads(landed, f"model.layers.{layer}.self_attn.attn", dim)[: len(loaded)]
            torch.testing.assert_close(tokens[..., :dim], k_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(tokens[..., dim:], v_ref, atol=1e-4, rtol=0)
            assert_heads_in_pools(tokens, pools, position, f"{n} tokens, layer {layer}")
        states = [whole_state(landed, f"model.layers.{i}.linear_attn", GDN) for i in GDN_LINEAR]
        for layer, (conv, rec) in zip(GDN_LINEAR, states, strict=True):
            conv_ref, rec_ref = hf_state[layer]
            torch.testing.assert_close(conv, conv_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(rec, rec_ref, atol=1e-4, rtol=0)
        assert_state_in_ranks(states, dumps, GDN, f"{n} tokens")
        _staging_whole(worker)
        wait_until(lambda: _metric(worker, AUX_USED) == 0, 10.0, "every state slot back")


def test_a_linear_model_from_a_tp_worker_to_a_decode_of_tp_1(
    gdn_served: tuple[Worker, str, Path], vllm_decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """Qwen3-Next at worker TP 2 into vLLM 0.34's decode of TP 1: the leader's whole slot
    staged in vLLM's page layout (both ranks' conv runs and value heads)."""
    _assert_gdn_pulls(gdn_served, _hybrid_decode([vllm_decode], gdn_served[2], "gdn"), tmp_path)


def test_a_linear_model_from_a_tp_worker_to_a_decode_of_tp_2(
    gdn_served: tuple[Worker, str, Path], decode_tp2: list[VllmDecodeProcess], tmp_path: Path
) -> None:
    """The same into a decode of TP 2: decode rank r reads its KV head and its share of each
    state page (vLLM's 3-read conv: its q, k and v channels; its value heads), which is worker
    rank r's own share, byte for byte."""
    _assert_gdn_pulls(gdn_served, _hybrid_decode(decode_tp2, gdn_served[2], "gdn"), tmp_path)


def test_a_push_decode_of_tp_2_from_a_tp_worker(
    served: tuple[Worker, str, Path], decode_tp2: list[VllmDecodeProcess], tmp_path: Path
) -> None:
    """vLLM's push decode of TP 2 (opened beside the pull decode in each rank's process, one
    side channel that rank 0 serves with both ranks' payloads) against the TP-2 worker: each
    decode rank is WRITten its head of every block, byte for byte the worker rank's that
    computed it, transformers' K/V; one push per request, no registration ignored."""
    worker, api, checkpoint = served
    version = decode_tp2[0].version
    if version not in VLLM_PUSH_VERSIONS:
        pytest.skip(f"push decodes of vLLM {VLLM_PUSH_VERSIONS} (PW_VLLM_PUSH_VERSIONS)")
    engine, channel = f"vllm-push-tp2-{version}", free_port()
    ranks = open_ranks(
        decode_tp2, "push", engine_id=engine, transfer_mode="push", side_channel_port=channel
    )
    payloads = [rank.call("meta")["payload"] for rank in ranks]
    ranks[0].call("serve", payloads=payloads)
    written = _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}')
    ignored = _ignored(worker)
    for n in (1, 33, 300):
        ids = prompt(n, seed=_seed(decode_tp2[0], 700 + n))
        params, rid = push_prefill(api, ids, version)
        for rank in ranks:
            rank.call("push", request_id=rid, params=params)
        landed = []
        for i, rank in enumerate(ranks):
            outcome = rank.call("wait", timeout_s=90, request_id=rid, deadline_s=60)
            assert outcome["finished"] and outcome["load_errors"] == [], (i, outcome)
            landed.append(rank.blocks(rid, tmp_path / f"push-tp2-{n}-{i}.npz"))
        assert all(raw.shape[1] == 1 for raw in landed[0].values())  # a head a rank
        both = {name: np.concatenate([r[name] for r in landed], axis=1) for name in landed[0]}
        pools = _pools(worker)
        for layer, tokens in enumerate(
            _assert_transformers_kv(both, hf_reference(checkpoint, ids)[1], n)
        ):
            assert_heads_in_pools(tokens, pools, layer, f"{n} tokens, layer {layer}")
        _staging_whole(worker)
    assert _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}') == written + 3
    assert _ignored(worker) == ignored  # the second rank's registration is its sibling
