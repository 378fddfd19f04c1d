"""An FP8 KV pool pulled by vLLM's own NixlConnector with an FP8 cache (``kv_cache_dtype``
"fp8", the newest vLLM only): our forward (the vLLM decode's tiny Qwen3, ``kv_dtype``
fp8_e4m3) fills the pool, this worker's vLLM backend (``transfer.vllm``, its staging repack)
serves it with the hash of an FP8 decode (model dtype float32, cache dtype "fp8"), and the
decode's blocks equal the float32 K/V of the same forward converted by vLLM's rule
(``reshape_and_cache``: ``k / k_scale``, scale 1.0, saturated at ±448, round to nearest
even), byte for byte. The session's decode process (``conftest.vllm_decode``, an ``auto``
cache) opens the FP8 decode beside itself (no second vLLM import) and is itself refused by
the hash: its pull ends in load errors, with vLLM's reason in its log."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.request import SamplingParams
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.options import NixlOptions, VllmIdentity, VllmOptions
from prefill_worker.transfer.vllm.backend import VllmBackend, our_hash
from prefill_worker.transfer.vllm.channel import serve_side_channels
from prefill_worker.transfer.vllm.tickets import Tickets
from tests.checkpoints import prompt
from tests.interop.vllm_decode import VLLM_VERSIONS, VllmDecodeProcess
from tests.polling import wait_until

pytestmark = pytest.mark.interop

PAGE, PAGES, BLOCK, BLOCKS = 16, 8, 32, 4
NUM_TOKENS = 45  # two vLLM blocks, the second partly filled
E4M3 = torch.float8_e4m3fn


def vllm_rule(values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """vLLM's FP8 cache write: ``x / scale``, saturated to ±448, round to nearest even."""
    return (values.float() / scale).clamp(-448.0, 448.0).to(E4M3)


def forward(path: Path, kv_dtype: str) -> Any:
    runner, kv_cache, _ = build(path, dtype="float32", page_size=PAGE, num_pages=PAGES,
                                kv_dtype=kv_dtype)  # fmt: skip
    ids = prompt(NUM_TOKENS, seed=11)
    pages = list(range(-(-NUM_TOKENS // PAGE)))
    runner.run(BatchPlan(0, (ChunkPlan("a", ids, 0, NUM_TOKENS, pages, SamplingParams()),)))
    return kv_cache


@pytest.fixture(scope="module")
def served(vllm_checkpoint: Path, vllm_decode: VllmDecodeProcess) -> Iterator[VllmBackend]:
    if vllm_decode.version != VLLM_VERSIONS[-1]:
        pytest.skip("FP8 KV is proved on the newest vLLM only")
    kv_cache = forward(vllm_checkpoint, "fp8_e4m3")
    identity = VllmIdentity(str(vllm_checkpoint), "CPU_ATTN", "fp8", "float32")
    options = VllmOptions("127.0.0.1", 0, BLOCK, BLOCKS, identity=identity,
                          versions=(vllm_decode.version,),
                          nixl=NixlOptions(None, ("UCX",), "lo"))  # fmt: skip
    tickets = Tickets(4, options.versions)
    backend = VllmBackend(kv_cache.regions(0, 0), options, tickets, serve_side_channels)
    yield backend
    backend.close()
    del kv_cache  # the pool the backend registered lives until the backend is closed


def prefill(backend: VllmBackend, room: int) -> dict[str, Any]:
    """The engine's part for one request: the pages staged, the answer's params."""
    assert backend.desk.tickets.open(room)
    sender = backend.create_sender(room, f"r{room}", NUM_TOKENS)
    assert sender.poll() is KVPoll.READY
    sender.send_pages(list(range(-(-NUM_TOKENS // PAGE))), 0)
    sender.send_aux(0)
    wait_until(lambda: sender.poll().is_terminal, what="the repack ends")
    assert sender.poll() is KVPoll.SUCCESS
    sender.close()
    params = backend.desk.tickets.take(room)
    assert params is not None
    return dict(params)


def pulled(backend: VllmBackend, decode: Any, request_id: str, params: dict[str, Any]) -> Any:
    """The decode's pull, with the backend turned (side channel, notices) meanwhile."""
    stop = threading.Event()

    def turn() -> None:
        while not stop.wait(0.005):
            backend.poll()

    thread = threading.Thread(target=turn, daemon=True)
    thread.start()
    try:
        return decode.pull_and_wait(request_id, params)
    finally:
        stop.set()
        thread.join(5)


def test_an_fp8_vllm_decode_pulls_vllms_own_fp8_bytes(
    served: VllmBackend, vllm_decode: VllmDecodeProcess, vllm_checkpoint: Path, tmp_path: Path
) -> None:
    fp8 = vllm_decode.open("fp8", cache_dtype="fp8", engine_id="vllm-decode-fp8", num_blocks=8)
    info = fp8.call("info")
    assert info["compat_hash"] == our_hash(served.registration, vllm_decode.version)
    assert info["block_bytes"] == served.registration.block_bytes  # 1 byte a value
    params = prefill(served, 1)
    outcome = pulled(served, fp8, "fp8-a", params)
    assert outcome["finished"] and outcome["load_errors"] == []
    blocks = fp8.blocks("fp8-a", tmp_path / "fp8.npz")
    reference = forward(vllm_checkpoint, "auto")  # the float32 K/V of the same forward
    for layer in range(reference.layout.num_layers):
        got = blocks[f"model.layers.{layer}.self_attn.attn"]  # [2, H, BLOCK, 2 D] bytes
        got = got.transpose(0, 2, 1, 3).reshape(2 * BLOCK, -1, got.shape[-1])[:NUM_TOKENS]
        k, v = (plane[layer].flatten(0, 1)[:NUM_TOKENS] for plane in (reference.k, reference.v))
        want = torch.cat([vllm_rule(k), vllm_rule(v)], dim=-1).view(torch.uint8).numpy()
        assert np.array_equal(got, want), layer  # [tokens, H, 2 D]: K‖V per (token, head)
        assert np.count_nonzero(want) > want.size // 2  # real values, not a zeroed block


def test_an_auto_cache_decode_is_refused_by_the_hash(
    served: VllmBackend, vllm_decode: VllmDecodeProcess
) -> None:
    params = prefill(served, 2)
    outcome = pulled(served, vllm_decode, "fp8-refused", params)
    assert outcome["finished"] and outcome["blocks"]
    assert outcome["load_errors"] == sorted(outcome["blocks"])
    log = vllm_decode.log_path.read_text(errors="replace")
    assert "NIXL compatibility hash mismatch" in log
