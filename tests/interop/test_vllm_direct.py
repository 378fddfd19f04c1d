"""vLLM push (and pull) straight from a pool in vLLM's block layout (``cache.layout:
vllm_blocks``, docs/vllm.md "A pool in vLLM's layout"): vLLM's own ``NixlPushConnector`` (the
session's push decodes, each version installed) and ``NixlConnector`` (the session's pull
decode) against a worker whose pool IS vLLM's LBHNC blocks, pages of 32 tokens = the decodes'
block size. Checked: transformers' K/V (fp32, 1e-4) for 1, 31, 32, 33 and 300 tokens; every
landed block byte for byte the worker's pool page the answer names (the blocks are the
request's own pages); no token staged (mirror and repack counters still, the pool's counter
+n), no staging region (capacity 0), no KV mirror attached (the pool dump says); a prefix hit
(the cached pages served, pinned, as they are); every pinned page back and the pool whole
after each. One worker for the module, serving both modes and every version."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.test_vllm_push import MODES, _post, _prefill, _pushed_ok, _seed, push_decode
from tests.interop.test_vllm_worker import (
    BLOCK,
    _assert_transformers_kv,
    _metric,
    _staged,
    _staging_whole,
    _start,
)
from tests.interop.test_vllm_worker_tp import _rank_pids
from tests.interop.vllm_decode import VLLM_PUSH_VERSIONS, VLLM_VERSIONS, VllmDecodeProcess
from tests.polling import wait_until

pytestmark = pytest.mark.interop

POOL = "prefill_worker_vllm_staged_tokens_total"


@pytest.fixture(scope="module")
def direct(
    tmp_path_factory: pytest.TempPathFactory, vllm_checkpoint: Path
) -> Iterator[tuple[Worker, str, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-direct-worker")
    settings = (MODES, "cache.layout=vllm_blocks", f"cache.page_size={BLOCK}")
    settings += (f"scheduler.chunk_size={BLOCK}",)  # chunks end on a page: a chunk a page
    worker, api = _start(tmp, vllm_checkpoint, vllm_checkpoint, *settings)
    try:
        worker.child.wait_ready(120)
        yield worker, api, vllm_checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(params=VLLM_PUSH_VERSIONS)
def decode(vllm_push_decodes: dict[str, VllmDecodeProcess], request: Any) -> VllmDecodeProcess:
    return push_decode(vllm_push_decodes, request.param)


def _lbhnc_pool(
    worker: Worker, rank: int = 0, pid: int | None = None
) -> tuple[list[torch.Tensor], bool]:
    """Rank ``rank``'s pool now as vLLM's blocks per layer, ``[pages, heads, 32, 2 * dim]``
    bytes (rebuilt from its dump's per-page K and V), and whether a KV mirror is attached."""
    dump = worker.child.log_path.parent / f"rank{rank}.pt"
    dump.unlink(missing_ok=True)
    os.kill(worker.child.popen.pid if pid is None else pid, signal.SIGUSR2)
    wait_until(dump.exists, 30.0, f"rank {rank}'s pool dump")
    pool = torch.load(dump)
    blocks = [
        torch.cat([k.transpose(1, 2), v.transpose(1, 2)], dim=-1).contiguous().view(torch.uint8)
        for k, v in zip(pool["k"], pool["v"], strict=True)
    ]  # [pages, heads, page_size, 2D] as bytes
    return blocks, bool(pool["mirror"])


def _from_the_pool(
    worker: Worker, landed: dict[str, np.ndarray], pages: list[int], pids: list[int] | None = None
) -> None:
    """Each landed block is, byte for byte, the pool page of the same place in the answer: at
    TP > 1 (``pids``: every rank's process) rank r's head r of it."""
    ranks = [None] if pids is None else pids
    for rank, pid in enumerate(ranks):
        blocks, mirrored = _lbhnc_pool(worker, rank, pid)
        assert not mirrored, f"a KV mirror is attached to rank {rank}'s vllm_blocks pool"
        for layer, pool in enumerate(blocks):
            raw = landed[f"model.layers.{layer}.self_attn.attn"]
            got = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8)
            heads = pool.shape[1]
            got = got.view(got.shape[0], -1, *pool.shape[2:])[:, rank * heads : (rank + 1) * heads]
            want = pool[pages]
            assert torch.equal(got, want), f"layer {layer} rank {rank}: not its pool page"


def test_vllm_push_writes_the_pool_pages_themselves(
    direct: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, checkpoint = direct
    assert _metric(worker, "prefill_worker_vllm_staging_blocks_capacity") == 0  # no region
    staged = _staged(worker)
    served = _metric(worker, POOL, '{how="pool"}')
    written = _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}')
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=_seed(decode, 600 + n))
        params, rid = _prefill(api, ids, decode.version)
        pages = params["remote_block_ids"][0]
        assert len(pages) == -(-n // BLOCK)
        _pushed_ok(decode.push_and_wait(rid, params))
        landed = decode.blocks(rid, tmp_path / f"{n}.npz")
        _assert_transformers_kv(landed, hf_reference(checkpoint, ids)[1], n)
        _from_the_pool(worker, landed, pages)
        served += n
        assert _staged(worker) == staged and _metric(worker, POOL, '{how="pool"}') == served
        _staging_whole(worker)  # the pages pinned for the WRITE are back, the pool whole
    assert _metric(worker, "prefill_worker_vllm_pushes_total", '{outcome="written"}') == written + 5
    assert _metric(worker, "prefill_worker_vllm_pool_pages_pinned") == 0


def test_a_prefix_hit_is_pushed_from_the_cached_pages(
    direct: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """A prompt whose first 64 tokens hit the worker's prefix cache: its answer names those
    cached pages (the first prompt's own), pinned, and the push lands them."""
    worker, api, checkpoint = direct
    base = prompt(100, seed=_seed(decode, 700))
    first, rid = _prefill(api, base, decode.version)
    _pushed_ok(decode.push_and_wait(rid, first))
    ids = base[:70] + prompt(30, seed=_seed(decode, 701))
    params, rid = _prefill(api, ids, decode.version)
    assert params["remote_block_ids"][0][:2] == first["remote_block_ids"][0][:2]  # the hit
    _pushed_ok(decode.push_and_wait(rid, params))
    landed = decode.blocks(rid, tmp_path / "hit.npz")
    _assert_transformers_kv(landed, hf_reference(checkpoint, ids)[1], 100)
    _from_the_pool(worker, landed, params["remote_block_ids"][0])
    _staging_whole(worker)


@pytest.mark.parametrize("vllm_decode", [VLLM_VERSIONS[-1]], indirect=True)
def test_a_pull_reads_the_pool_pages_themselves(
    direct: tuple[Worker, str, Path], vllm_decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """The pull falls out of the same pages: vLLM's pull decode READs them, and its
    notification unpins them (the session's pull decode, newest version)."""
    worker, api, checkpoint = direct
    ids = prompt(300, seed=703)
    status, answer, _ = _post(api, ids, vllm_decode.version, "pull")
    assert status == 200, answer
    params = dict(answer["kv_transfer_params"])
    assert params["transfer_mode"] == "pull"
    outcome = vllm_decode.pull_and_wait("direct-pull", params)
    assert outcome["finished"] and outcome["load_errors"] == [], outcome
    pulled = vllm_decode.blocks("direct-pull", tmp_path / "pulled.npz")
    _assert_transformers_kv(pulled, hf_reference(checkpoint, ids)[1], 300)
    _from_the_pool(worker, pulled, params["remote_block_ids"][0])
    _staging_whole(worker)  # the READ's notification unpinned the pages
    assert _metric(worker, "prefill_worker_vllm_holds_total", '{outcome="read"}') >= 1


@pytest.fixture(scope="module")
def direct_tp2(
    tmp_path_factory: pytest.TempPathFactory, vllm_checkpoint: Path
) -> Iterator[tuple[Worker, str, Path]]:
    """The same pool at worker TP 2: each rank's pool is its head of the group's pool, in
    memory the ranks share, which the leader's agent registers (``service.vllm_group``)."""
    tmp = tmp_path_factory.mktemp("vllm-direct-worker-tp2")
    settings = (MODES, "cache.layout=vllm_blocks", f"cache.page_size={BLOCK}")
    settings += (f"scheduler.chunk_size={BLOCK}", "transfer.protocol=vllm", "parallel.tp_size=2")
    settings += ("scheduler.optimistic_prefill=false",)
    worker, api = _start(tmp, vllm_checkpoint, vllm_checkpoint, *settings)
    try:
        worker.child.wait_ready(180)
        yield worker, api, vllm_checkpoint
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def test_a_tp_2_worker_pushes_every_rank_s_head_from_its_pool(
    direct_tp2: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """Both ranks' heads WRITten straight from the group's pool: head r of every landed block
    is rank r's own pool page, byte for byte; nothing staged, no mirror on either rank."""
    worker, api, checkpoint = direct_tp2
    assert _metric(worker, "prefill_worker_vllm_staging_blocks_capacity") == 0
    pids = _rank_pids(worker)
    staged = _staged(worker)
    for n in (1, 31, 32, 33, 300):
        ids = prompt(n, seed=_seed(decode, 800 + n))
        params, rid = _prefill(api, ids, decode.version)
        _pushed_ok(decode.push_and_wait(rid, params))
        landed = decode.blocks(rid, tmp_path / f"tp2-{n}.npz")
        _assert_transformers_kv(landed, hf_reference(checkpoint, ids)[1], n)
        _from_the_pool(worker, landed, params["remote_block_ids"][0], pids)
        assert _staged(worker) == staged
        _staging_whole(worker)
