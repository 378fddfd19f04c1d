"""A linear-attention hybrid (Qwen3-Next: linear, full, linear, linear, full; gated DeltaNet)
from the real worker to vLLM 0.34's own ``NixlConnector`` decode half on CPU, its KV cache
built as vLLM's engine builds a hybrid one (``vllm_child_groups``: GDN ``MambaSpec`` pages
padded to the attention page; vLLM's ``get_kv_cache_groups`` gives [L0 L3] [L2] (mamba) and
[L1 L4] (full); vLLM's scheduler half clips each mamba group to its one state block).

vLLM's decode wants the KV and the state after all but the last prompt token (it computes the
last itself): the worker's HTTP front cuts a pull's prompt one token short, so the answer says
``remote_num_tokens`` N-1 and names one block per mamba group. vLLM reads with no load error:
the full layers' K/V byte for byte the worker's pool and transformers' (fp32, 1e-4) for
``ids[:-1]``, each linear layer's conv state and recurrent matrix (vLLM's ``[Hv, Dv, Dk]``)
transformers' after ``ids[:-1]`` within 1e-4. A vLLM 0.33 request is refused 400
(``state_unsupported``); staging and pool whole after each.

Needs ``compressed-tensors`` and ``loguru`` in the vLLM 0.34 interop environment (vLLM
imports them to inspect a GDN model); skipped without them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import Worker
from tests.interop.test_vllm_worker import (
    BLOCK,
    PAGE,
    _in_pool,
    _pool,
    _post,
    _prefill,
    _staging_whole,
    _start,
)
from tests.interop.vllm_decode import INTEROP_DIR, VllmDecodeProcess, vllm_pythonpath

pytestmark = pytest.mark.interop

VERSION = "0.34.0"
GROUP_OF = {0: 0, 3: 0, 2: 1, 1: 2, 4: 2}  # vLLM's groups: [L0 L3] [L2] mamba, [L1 L4] full
LINEAR, FULL = (0, 2, 3), (1, 4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vllm_pythonpath(VERSION)  # skip before building anything
    env = INTEROP_DIR / f"vllm-{VERSION}"
    if not ((env / "compressed_tensors").exists() and (env / "loguru").exists()):
        pytest.skip(f"{env} lacks compressed-tensors and loguru (vLLM's GDN model import)")
    return make_checkpoint("qwen3_next", tmp_path_factory.mktemp("vllm-gdn") / "qwen3_next")


@pytest.fixture(scope="module")
def decode(checkpoint: Path) -> Iterator[VllmDecodeProcess]:
    log_path = checkpoint.parent / "decode.log"
    process = VllmDecodeProcess(checkpoint, log_path, num_blocks=64, version=VERSION)
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, decode: VllmDecodeProcess
) -> Iterator[tuple[Worker, str]]:
    tmp = tmp_path_factory.mktemp("vllm-gdn-worker")
    worker, api = _start(tmp, checkpoint, checkpoint, "scheduler.optimistic_prefill=false")
    try:
        worker.child.wait_ready(120)
        assert decode.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"  # vLLM up
        yield worker, api
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def _hf(checkpoint: Path, ids: list[int]):  # type: ignore[no-untyped-def]
    """Transformers after ``ids``: {full layer: (k, v) [S, KV, D]}, {linear layer: (conv
    [C, K-1], recurrent [Hv, Dk, Dv])}."""
    with torch.no_grad():
        layers = hf_model(checkpoint)(torch.tensor([ids]), use_cache=True).past_key_values.layers
    kv = {i: (layers[i].keys[0].transpose(0, 1), layers[i].values[0].transpose(0, 1)) for i in FULL}
    state = {
        i: (layers[i].conv_states[0][0, :, 1:], layers[i].recurrent_states[0][0]) for i in LINEAR
    }
    return kv, state


def test_vllm_pulls_the_kv_and_the_state_one_token_short(
    served: tuple[Worker, str], decode: VllmDecodeProcess, checkpoint: Path, tmp_path: Path
) -> None:
    worker, api = served
    for n in (2, 40, 70):
        ids = prompt(n, seed=500 + n)
        params = _prefill(api, ids, VERSION)
        assert params["remote_num_tokens"] == n - 1  # vLLM's decode computes the last token
        num_blocks = -(-(n - 1) // BLOCK)
        assert [len(g) for g in params["remote_block_ids"]] == [1, 1, num_blocks]
        outcome = decode.pull_and_wait(f"gdn-{n}", params)
        assert outcome["finished"] and outcome["load_errors"] == [], outcome
        pulled = decode.blocks(f"gdn-{n}", tmp_path / f"{n}.npz")
        pool_k, pool_v = _pool(worker)
        hf_kv, hf_state = _hf(checkpoint, ids[:-1])
        for position, layer in enumerate(FULL):
            k_ref, v_ref = hf_kv[layer]
            heads, dim = k_ref.shape[1], k_ref.shape[2]
            raw = pulled[f"model.layers.{layer}.self_attn.attn"]
            kv = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32))
            tokens = kv.transpose(1, 2).reshape(-1, heads, 2 * dim)[: n - 1]
            torch.testing.assert_close(tokens[..., :dim], k_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(tokens[..., dim:], v_ref, atol=1e-4, rtol=0)
            assert _in_pool(pool_k[position], tokens[..., :dim], PAGE), f"K {n} {layer}"
            assert _in_pool(pool_v[position], tokens[..., dim:], PAGE), f"V {n} {layer}"
        for layer in LINEAR:
            conv_ref, rec_ref = hf_state[layer]
            page = pulled[f"model.layers.{layer}.linear_attn"][0]  # its one state block
            conv_bytes = conv_ref.numel() * 4
            conv = torch.from_numpy(page[:conv_bytes].copy().view(np.float32))
            rec = torch.from_numpy(page[conv_bytes : conv_bytes + rec_ref.numel() * 4].copy())
            rec = rec.view(torch.float32).reshape(rec_ref.shape[0], *rec_ref.shape[:0:-1])
            torch.testing.assert_close(conv.reshape(conv_ref.shape), conv_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(rec.transpose(1, 2), rec_ref, atol=1e-4, rtol=0)
        _staging_whole(worker)


def test_a_request_for_vllm_0_33_is_refused_with_the_reason(served: tuple[Worker, str]) -> None:
    worker, api = served
    status, answer = _post(api, prompt(40, seed=550), "0.33.0")
    assert status == 400, answer
    assert "state_unsupported: vLLM 0.33.0 decodes get no linear-attention" in str(answer)
    _staging_whole(worker)
