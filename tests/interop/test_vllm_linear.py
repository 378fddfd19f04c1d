"""Linear-attention hybrids (linear, full, linear, linear, full; gated DeltaNet) from the real
worker to vLLM 0.34's own ``NixlConnector`` decode half on CPU, its KV cache built as vLLM's
engine builds a hybrid one (``vllm_child_groups``: GDN ``MambaSpec`` pages padded to the
attention page; vLLM's ``get_kv_cache_groups`` gives [L0 L3] [L2] (mamba) and [L1 L4] (full);
vLLM's scheduler half clips each mamba group to its one state block).

vLLM's decode wants the KV and the state after all but the last prompt token (it computes the
last itself): the worker's HTTP front cuts a pull's prompt one token short, so the answer says
``remote_num_tokens`` N-1 and names one block per mamba group. vLLM reads with no load error:
the full layers' K/V byte for byte the worker's pool and transformers' (fp32, 1e-4) for
``ids[:-1]``, each linear layer's conv state and recurrent matrix (vLLM's ``[Hv, Dv, Dk]``)
transformers' after ``ids[:-1]`` within 1e-4; three prompts prefilled in one batch and
held together, read last first, each its own state. A state never read returns at the lease;
a vLLM 0.33 request is refused 400 (``state_unsupported``). After each: every staging block
(with its state pages), pool page and state slot (aux row) back, from the worker's metrics.

One decode for the module, of the tiny Qwen3-Next config; a worker per family
(``PW_VLLM_GDN_FAMILIES``: Qwen3.5 by default, Qwen3-Next too on request), each serving its
own checkpoint to it (same dims; each its own weight layout and transformers model). vLLM
0.34's Qwen3.5 model module cannot be imported here (it imports Qwen3-VL's image processor,
which needs torchvision, and no CPU torchvision wheel is reachable for this torch), so the
decode of a Qwen3.5 worker is configured as Qwen3-Next: what the connector reads is the same,
as vLLM builds it (its ``Qwen3_5ForCausalLM`` and ``Qwen3NextForCausalLM`` declare the state
with the same ``gated_delta_net_state_shape``, name the layers ``model.layers.<i>.linear_attn``
and ``model.layers.<i>.self_attn.attn``, and the compatibility hash covers no architecture).

Needs ``compressed-tensors`` and ``loguru`` in the vLLM 0.34 interop environment (vLLM
imports them to inspect a GDN model); skipped without them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import Worker
from tests.interop.test_vllm_worker import (
    BLOCK,
    LEASE_S,
    PAGE,
    _in_pool,
    _metric,
    _pool,
    _post,
    _prefill,
    _staging_whole,
    _start,
)
from tests.interop.vllm_decode import INTEROP_DIR, VllmDecodeProcess, vllm_pythonpath
from tests.polling import wait_until

pytestmark = pytest.mark.interop

VERSION = "0.34.0"
# The worker's families, each a worker start (~20 s): Qwen3.5 by default, to keep `make
# interop` short; PW_VLLM_GDN_FAMILIES="qwen3_next qwen3_5" runs both (both passed when built).
FAMILIES = tuple(os.environ.get("PW_VLLM_GDN_FAMILIES", "qwen3_5").split())
LINEAR, FULL = (0, 2, 3), (1, 4)  # vLLM's groups: [L0 L3] [L2] mamba, [L1 L4] full
AUX_USED = "prefill_worker_aux_rows_used"  # a hybrid's state slot is its aux row
EXPIRED = '{outcome="expired"}'


@pytest.fixture(scope="module")
def decode_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The decode's model: the tiny Qwen3-Next (its config; the decode loads no weights)."""
    vllm_pythonpath(VERSION)  # skip before building anything
    env = INTEROP_DIR / f"vllm-{VERSION}"
    if not ((env / "compressed_tensors").exists() and (env / "loguru").exists()):
        pytest.skip(f"{env} lacks compressed-tensors and loguru (vLLM's GDN model import)")
    return make_checkpoint("qwen3_next", tmp_path_factory.mktemp("vllm-gdn") / "qwen3_next")


@pytest.fixture(scope="module")
def decode(decode_model: Path) -> Iterator[VllmDecodeProcess]:
    log_path = decode_model.parent / "decode.log"
    process = VllmDecodeProcess(decode_model, log_path, num_blocks=64, version=VERSION)
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    decode_model: Path,
    decode: VllmDecodeProcess,
) -> Iterator[tuple[Worker, str, Path]]:
    """A worker serving the family's checkpoint to the decode (its hash names the decode's
    model): (worker, its API, its checkpoint)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-gdn-{family}")
    checkpoint = decode_model if family == "qwen3_next" else make_checkpoint(family, tmp / family)
    worker, api = _start(tmp, checkpoint, decode_model, "scheduler.optimistic_prefill=false")
    try:
        worker.child.wait_ready(120)
        assert decode.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"  # vLLM up
        yield worker, api, checkpoint
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


def _assert_pulled(
    served: tuple[Worker, str, Path],
    decode: VllmDecodeProcess,
    ids: list[int],
    params: dict[str, Any],
    tmp_path: Path,
) -> None:
    """vLLM's pull of ``params`` (a prompt of ``ids``) ends with no load error; the full
    layers' blocks hold transformers' and the worker pool's K/V of ``ids[:-1]``, each linear
    layer's one state block transformers' conv and recurrent state after ``ids[:-1]`` (after
    ``ids`` for one token: vLLM backs off only past it, its prefill and decode alike)."""
    worker, _, checkpoint = served
    loaded = ids[:-1] if len(ids) > 1 else ids
    n, name = len(loaded), f"gdn-{checkpoint.name}-{tmp_path.name}-{len(ids)}"
    outcome = decode.pull_and_wait(name, params)
    assert outcome["finished"] and outcome["load_errors"] == [], outcome
    pulled = decode.blocks(name, tmp_path / f"{name}.npz")
    pool_k, pool_v = _pool(worker)
    hf_kv, hf_state = _hf(checkpoint, loaded)
    for position, layer in enumerate(FULL):
        k_ref, v_ref = hf_kv[layer]
        heads, dim = k_ref.shape[1], k_ref.shape[2]
        raw = pulled[f"model.layers.{layer}.self_attn.attn"]
        kv = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32))
        tokens = kv.transpose(1, 2).reshape(-1, heads, 2 * dim)[:n]
        torch.testing.assert_close(tokens[..., :dim], k_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(tokens[..., dim:], v_ref, atol=1e-4, rtol=0)
        assert _in_pool(pool_k[position], tokens[..., :dim], PAGE), f"K {name} {layer}"
        assert _in_pool(pool_v[position], tokens[..., dim:], PAGE), f"V {name} {layer}"
    for layer in LINEAR:
        conv_ref, rec_ref = hf_state[layer]
        page = pulled[f"model.layers.{layer}.linear_attn"][0]  # its one state block
        conv_bytes = conv_ref.numel() * 4
        conv = torch.from_numpy(page[:conv_bytes].copy().view(np.float32))
        rec = torch.from_numpy(page[conv_bytes : conv_bytes + rec_ref.numel() * 4].copy())
        rec = rec.view(torch.float32).reshape(rec_ref.shape[0], *rec_ref.shape[:0:-1])
        torch.testing.assert_close(conv.reshape(conv_ref.shape), conv_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(rec.transpose(1, 2), rec_ref, atol=1e-4, rtol=0)


def _whole(worker: Worker) -> None:
    """Every staging block (and with it its state pages), pool page and state slot back."""
    _staging_whole(worker)
    wait_until(lambda: _metric(worker, AUX_USED) == 0, 10.0, "every state slot (aux row) back")


def test_vllm_pulls_the_kv_and_the_state_one_token_short(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    worker, api, _ = served
    for n in (1, 2, 40, 70):  # a token, two, a chunk (16) and a block (32) past, several
        ids = prompt(n, seed=500 + n)
        status, answer = _post(api, ids, VERSION)
        assert status == 200, answer
        params = answer["kv_transfer_params"]
        loaded = max(n - 1, 1)  # vLLM's decode computes the last token (of more than one)
        assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"] == loaded
        num_blocks = -(-loaded // BLOCK)
        assert [len(g) for g in params["remote_block_ids"]] == [1, 1, num_blocks]
        _assert_pulled(served, decode, ids, params, tmp_path)
        _whole(worker)


def test_requests_held_together_get_their_own_state_and_an_unread_one_expires(
    served: tuple[Worker, str, Path], decode: VllmDecodeProcess, tmp_path: Path
) -> None:
    """Three prompts at once (one batch, three state slots) and a fourth no decode reads, all
    held before any is read, then read last first: each decode gets its own request's state;
    every slot is back once the states are staged, the unread hold's blocks at its lease."""
    worker, api, _ = served
    before = _metric(worker, "prefill_worker_vllm_holds_total", EXPIRED)
    prompts = [prompt(n, seed=600 + n) for n in (33, 20, 50, 40)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ids: _prefill(api, ids, VERSION), prompts))
    assert len({a["remote_block_ids"][0][0] for a in answers}) == len(prompts)  # own pages
    wait_until(lambda: _metric(worker, AUX_USED) == 0, 10.0, "the slots back before the reads")
    for ids, params in list(zip(prompts, answers, strict=True))[2::-1]:
        _assert_pulled(served, decode, ids, params, tmp_path)
    wait_until(
        lambda: _metric(worker, "prefill_worker_vllm_holds_total", EXPIRED) == before + 1,
        LEASE_S + 10,
        "the unread hold's lease",
    )
    _whole(worker)


def test_a_request_for_vllm_0_33_is_refused_with_the_reason(
    served: tuple[Worker, str, Path],
) -> None:
    worker, api, _ = served
    status, answer = _post(api, prompt(40, seed=550), "0.33.0")
    assert status == 400, answer
    assert "state_unsupported: vLLM 0.33.0 decodes get no linear-attention" in str(answer)
    _whole(worker)
