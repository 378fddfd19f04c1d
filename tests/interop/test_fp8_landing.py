"""An FP8 KV pool lands in SGLang's own FP8 decode pool byte for byte: our forward (a tiny
Qwen3 checkpoint, ``cache.kv_dtype: fp8_e4m3``) fills the worker's pool, this worker's SGLang
backend pushes a prompt's pages into SGLang's decode (``NixlKVReceiver`` over a real
``MHATokenToKVPool`` built with ``torch.float8_e4m3fn``, which SGLang stores as bytes), and
every landed page equals the float32 K/V of the same forward cast to e4m3 as SGLang's
``set_kv_buffer`` casts (scale 1.0), and transformers' K/V cast alike but for a few values at a
rounding boundary (our float32 K/V and transformers' differ in the last bits, within 1e-4),
which land as the adjacent e4m3 code. The worker announces ``kv_cache_dtype`` fp8_e4m3 on
``/route``; a decode that runs ``auto`` refuses it with SGLang's own reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.layout import KVLayout
from prefill_worker.model import build
from prefill_worker.request import SamplingParams
from prefill_worker.testing.json_child import DecodeError
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.interop.decodes import SglangDecode
from tests.interop.rig import push
from tests.interop.test_landing import InProcessWorker

pytestmark = pytest.mark.interop

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 32  # tests/checkpoints.py's qwen3
WORKER_PAGES = 32
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def forward_pool(path: Path, ids: list[int], layout: KVLayout, kv_dtype: str):  # type: ignore[no-untyped-def]
    """Our forward over ``ids`` into a pool whose page p holds tokens [p ps, (p+1) ps)."""
    runner, kv_cache, _ = build(path, dtype="float32", page_size=layout.page_size,
                                num_pages=layout.num_pages, kv_dtype=kv_dtype)  # fmt: skip
    pages = list(range(layout.num_pages))
    runner.run(BatchPlan(0, (ChunkPlan("a", ids, 0, len(ids), pages, SamplingParams()),)))
    return kv_cache


def page_bytes(plane: torch.Tensor, page: int) -> np.ndarray:
    return plane[page].contiguous().view(torch.uint8).numpy().ravel()


def fill(worker: InProcessWorker, kv_cache) -> None:  # type: ignore[no-untyped-def]
    """The FP8 pool's pages copied into the worker's pool (K of layer l: region l, V: L + l)."""
    n = worker.layout.num_layers
    for layer in range(n):
        for region, plane in ((layer, kv_cache.k[layer]), (n + layer, kv_cache.v[layer])):
            for page in range(worker.layout.num_pages):
                worker.page(region, page)[:] = page_bytes(plane, page)


def hf_kv(model: torch.nn.Module, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
            for layer in out.past_key_values.layers]  # fmt: skip


def check_near(landed: np.ndarray, reference: torch.Tensor) -> int:
    """``landed`` (e4m3 bytes) against float ``reference`` values cast by SGLang's rule: equal,
    or (where the float32 values differ from ours in the last bits and sit at a rounding
    boundary) the adjacent e4m3 code. The number of such bytes."""
    wanted = reference.to(E4M3).view(torch.uint8).numpy().ravel().astype(np.int16)
    differ = np.flatnonzero(landed.astype(np.int16) != wanted)
    assert (np.abs(landed.astype(np.int16)[differ] - wanted[differ]) == 1).all()
    return len(differ)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_pages_land_as_sglang_would_have_written_them(
    decode_process: SglangDecodeProcess, qwen3: Path, tmp_path: Path, page_size: int
) -> None:
    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "fp8_e4m3", page_size, WORKER_PAGES)
    worker = InProcessWorker(layout)
    try:
        ids = prompt(WORKER_PAGES * page_size, seed=7)
        fill(worker, forward_pool(qwen3, ids, layout, "fp8_e4m3"))
        reference = forward_pool(qwen3, ids, layout, "auto")  # float32 K/V of the same forward
        theirs = hf_kv(hf_model(qwen3), ids)
        decode_layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "fp8_e4m3", page_size, 48)
        decode = SglangDecode(decode_process, worker.bootstrap, decode_layout)
        room, num_pages = 4242 + page_size, 9
        decode.want(room, num_pages * page_size - page_size // 2)
        _, src = push(worker, room, num_pages * page_size - page_size // 2, 4)
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        num_adjacent = num_bytes = 0
        for layer in range(NUM_LAYERS):
            for i, page in enumerate(src):
                tokens = slice(page * page_size, (page + 1) * page_size)
                k, v = landed.k[layer][i], landed.v[layer][i]
                pairs = ((k, reference.k[layer], theirs[layer][0]),
                         (v, reference.v[layer], theirs[layer][1]))  # fmt: skip
                for got, plane, hf_plane in pairs:
                    cast = plane[page].to(E4M3).contiguous().view(torch.uint8).numpy().ravel()
                    assert np.array_equal(got, cast), (layer, i)  # SGLang's rule, byte for byte
                    num_adjacent += check_near(got, hf_plane[tokens])
                    num_bytes += got.size
        assert num_adjacent <= num_bytes // 1000  # transformers' K/V: the same but a few ties
        worker.check_whole()
    finally:
        worker.backend.close()


def test_a_decode_without_fp8_refuses_the_worker(decode_process: SglangDecodeProcess) -> None:
    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "fp8_e4m3", 16, WORKER_PAGES)
    worker = InProcessWorker(layout)
    try:
        bf16 = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "bfloat16", 16, 48)
        decode = SglangDecode(decode_process, worker.bootstrap, bf16)
        with pytest.raises(DecodeError, match="KV cache dtype mismatch"):
            decode.want(77, 40)
    finally:
        worker.backend.close()
