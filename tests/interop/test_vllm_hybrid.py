"""A sliding-window model (gpt-oss: sliding, full, sliding; window 24) from the real worker to
vLLM 0.34's own ``NixlConnector`` decode half on CPU, its KV cache built as vLLM's engine builds
a hybrid one (``vllm_child_groups``: vLLM's ``get_kv_cache_groups`` puts the layers in three
groups, [L0] [L2] [L1]; vLLM's scheduler half clips each sliding group to the blocks its window
needs, 2 of 32 tokens here). The worker advertises each layer's group and answers one block
list per group, a sliding group's its window's: vLLM pairs every region (its groups match
ours, else it raises), reads with no load error, the full layer's every token and the sliding
layers' window blocks byte for byte the worker's pool, transformers' K/V within 1e-4 (fp32)
where transformers keeps them. A request naming vLLM 0.33 is refused by the HTTP front
(``swa_unsupported``, 400 with the reason); staging and pool whole after each. The same from a
second worker whose sliding layers keep only their window (``cache.sliding_pool windowed``):
the full layer's every token, the sliding layers' held window byte for byte its sliding pages,
the window blocks' earlier positions zeros, its sliding pool whole. One decode for the module
(it imports vLLM: ~1 min), pulling from both workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import Worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.interop.test_vllm_worker import (
    BLOCK,
    PAGE,
    _in_pool,
    _metric,
    _pool,
    _post,
    _prefill,
    _staging_whole,
    _start,
)
from tests.interop.vllm_decode import VllmDecodeProcess, vllm_pythonpath
from tests.polling import wait_until

pytestmark = pytest.mark.interop

VERSION = "0.34.0"
WINDOW = 24  # the checkpoints' sliding_window
KEPT = WINDOW - 1  # the positions transformers' sliding cache keeps (all a decode reads)
WINDOW_BLOCKS = -(-WINDOW // BLOCK) + 1  # vLLM's cdiv(sliding_window, block_size) + 1
FAMILIES = {  # vLLM's layer name suffix, each layer's group (tests/checkpoints.py's layers)
    "gpt_oss": ("attn.attn", {0: 0, 2: 1, 1: 2}),  # sliding, full, sliding: [L0] [L2] [L1]
    "gemma3": ("self_attn.attn", {0: 0, 2: 1, 3: 2, 1: 3}),  # [L0] [L2] [L3] [L1]
}
# gpt-oss by default (each family is a decode process importing vLLM, ~1 min);
# PW_VLLM_SWA_FAMILIES="gpt_oss gemma3" runs both, as they passed when this was built.
SLIDING_USED = "prefill_worker_sliding_pages_used"  # a windowed worker's sliding pool
RUN_FAMILIES = os.environ.get("PW_VLLM_SWA_FAMILIES", "gpt_oss").split()


@pytest.fixture(scope="module", params=RUN_FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    vllm_pythonpath(VERSION)  # skip before building anything
    return make_checkpoint(family, tmp_path_factory.mktemp("vllm-swa") / family)


@pytest.fixture(scope="module")
def decode(checkpoint: Path) -> Iterator[VllmDecodeProcess]:
    log_path = checkpoint.parent / "decode.log"
    process = VllmDecodeProcess(checkpoint, log_path, num_blocks=128, version=VERSION)
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, decode: VllmDecodeProcess
) -> Iterator[tuple[Worker, str]]:
    tmp = tmp_path_factory.mktemp("vllm-swa-worker")
    worker, api = _start(tmp, checkpoint, checkpoint, "scheduler.optimistic_prefill=false")
    try:
        worker.child.wait_ready(120)
        assert decode.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"  # vLLM up
        yield worker, api
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture(scope="module")
def windowed(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, decode: VllmDecodeProcess
) -> Iterator[tuple[Worker, str]]:
    """A second worker, its sliding layers in their own page space (``cache.sliding_pool
    windowed``): the same decode pulls from both (its blocks are never freed: 128 do)."""
    tmp = tmp_path_factory.mktemp("vllm-swa-windowed")
    worker, api = _start(
        tmp,
        checkpoint,
        checkpoint,
        "scheduler.optimistic_prefill=false",
        "cache.sliding_pool=windowed",
        'transfer.vllm_versions=["0.34.0"]',
    )
    try:
        worker.child.wait_ready(120)
        yield worker, api
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def _tokens(raw: np.ndarray, heads: int, dim: int) -> torch.Tensor:
    """A layer's pulled blocks (bytes ``[n, H, 32, 2D]``) as its tokens ``[n*32, H, 2D]``."""
    kv = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32))
    return kv.transpose(1, 2).reshape(-1, heads, 2 * dim)


def test_vllm_pulls_the_full_layers_and_the_sliding_windows(
    served: tuple[Worker, str],
    decode: VllmDecodeProcess,
    family: str,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    worker, api = served
    suffix, group_of = FAMILIES[family]
    full = max(group_of.values())  # the full layer's group: the last
    for n in (1, 33, 70, 150):
        ids = prompt(n, seed=300 + n)
        params = _prefill(api, ids, VERSION)
        num_blocks = -(-n // BLOCK)
        sent = params["remote_block_ids"]
        window = min(num_blocks, WINDOW_BLOCKS)
        want = [num_blocks if g == full else window for g in range(full + 1)]
        assert [len(g) for g in sent] == want
        outcome = decode.pull_and_wait(f"swa-{n}", params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"swa-{n}", tmp_path / f"{n}.npz")
        pool_k, pool_v = _pool(worker)
        _, hf_kv = hf_reference(checkpoint, ids)
        for layer, (k_ref, v_ref) in enumerate(hf_kv):
            heads, dim = k_ref.shape[1], k_ref.shape[2]
            tokens = _tokens(pulled[f"model.layers.{layer}.{suffix}"], heads, dim)
            first = (num_blocks - len(sent[group_of[layer]])) * BLOCK  # the blocks' first token
            tokens = tokens[: n - first]
            kept = n if group_of[layer] == full else min(n, KEPT)  # what transformers keeps
            torch.testing.assert_close(tokens[-kept:, :, :dim], k_ref[-kept:], atol=1e-4, rtol=0)
            torch.testing.assert_close(tokens[-kept:, :, dim:], v_ref[-kept:], atol=1e-4, rtol=0)
            assert _in_pool(pool_k[layer], tokens[..., :dim], PAGE), f"K {n} layer {layer}"
            assert _in_pool(pool_v[layer], tokens[..., dim:], PAGE), f"V {n} layer {layer}"
        _staging_whole(worker)


def test_a_request_for_vllm_0_33_is_refused_with_the_reason(served: tuple[Worker, str]) -> None:
    worker, api = served
    status, answer = _post(api, prompt(40, seed=350), "0.33.0")
    assert status == 400, answer  # before the engine sees it
    assert "swa_unsupported: vLLM 0.33.0 decodes get no sliding-window KV-cache groups" in str(
        answer
    ), answer
    _staging_whole(worker)


def test_a_windowed_worker_sends_the_full_layers_and_the_held_windows(
    windowed: tuple[Worker, str],
    decode: VllmDecodeProcess,
    family: str,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    """From a windowed pool (``transfer/vllm/window_staging.py``): the same block lists; the
    full layer's every token and each sliding layer's held window (from the page of position
    ``n - 23`` on) byte for byte the worker's pool (its sliding pages), transformers' K/V
    where transformers keeps them; the sliding blocks' positions before the held window are
    zeros; staging, pool and sliding pool whole after each prompt."""
    worker, api = windowed
    suffix, group_of = FAMILIES[family]
    full = max(group_of.values())
    for n in (1, 31, 33, 300):  # one page; a block's worth; two blocks; the window's 2 of 10
        ids = prompt(n, seed=400 + n)
        params = _prefill(api, ids, VERSION)
        num_blocks = -(-n // BLOCK)
        sent = params["remote_block_ids"]
        window = min(num_blocks, WINDOW_BLOCKS)
        assert [len(g) for g in sent] == [
            num_blocks if g == full else window for g in range(full + 1)
        ]
        outcome = decode.pull_and_wait(f"windowed-{n}", params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"windowed-{n}", tmp_path / f"{n}.npz")
        pool_k, pool_v = _pool(worker)  # the sliding layers' own pages for those layers
        _, hf_kv = hf_reference(checkpoint, ids)
        for layer, (k_ref, v_ref) in enumerate(hf_kv):
            heads, dim = k_ref.shape[1], k_ref.shape[2]
            tokens = _tokens(pulled[f"model.layers.{layer}.{suffix}"], heads, dim)
            first = (num_blocks - len(sent[group_of[layer]])) * BLOCK  # the blocks' first token
            tokens = tokens[: n - first]
            held = 0  # the first position the worker holds of this layer, from ``first``
            if group_of[layer] != full:
                held = max(first, max(0, n - KEPT) // PAGE * PAGE) - first
                assert not tokens[:held].view(torch.int32).any(), f"{n} layer {layer}: zeros"
            kept = n if group_of[layer] == full else min(n, KEPT)  # what transformers keeps
            torch.testing.assert_close(tokens[-kept:, :, :dim], k_ref[-kept:], atol=1e-4, rtol=0)
            torch.testing.assert_close(tokens[-kept:, :, dim:], v_ref[-kept:], atol=1e-4, rtol=0)
            assert _in_pool(pool_k[layer], tokens[held:, :, :dim], PAGE), f"K {n} layer {layer}"
            assert _in_pool(pool_v[layer], tokens[held:, :, dim:], PAGE), f"V {n} layer {layer}"
        _staging_whole(worker)
        wait_until(lambda: _metric(worker, SLIDING_USED) == 0, 10.0, "the sliding pool whole")
