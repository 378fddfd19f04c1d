"""An FP8 KV pool (``kv_dtype="fp8_e4m3"``): the forward writes every K/V (or MLA latent row)
as the decode families cast it (scale 1.0: ``torch.float8_e4m3fn``, SGLang's
``set_kv_buffer``), and attention reads the FP8 pages back for a later chunk.

Byte-exact: the FP8 pool's bytes equal our own float32 pool's K/V cast to e4m3 (a chunk from
position 0 attends over its fresh K/V, so the FP8 pool changes nothing the forward computes),
and transformers' K/V cast alike but for values at a rounding boundary (the adjacent code).
Read back: a prompt in two chunks, whose second chunk attends over the first one's FP8 pages,
gives the logits of a hand-built reference (the float32 run's K/V rounded
through e4m3) and differs from the float32 pool's, so the rounding is really read.
"""

from __future__ import annotations

import pytest
import torch

from prefill_worker.kv.layout import KVLayout
from prefill_worker.model import build
from prefill_worker.model.quant.kv import check_kv_backend
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import (
    PAGE_SIZE,
    chunk,
    hf_forward,
    hf_mla_forward,
    hf_model,
    plan,
    prompt,
    scattered_pages,
)

E4M3 = torch.float8_e4m3fn
IDS = [prompt(45, seed=1), prompt(20, seed=2)]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return request.param, make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def ours(path, kv_dtype: str, pool_layout: str = "layer_major"):  # type: ignore[no-untyped-def]
    return build(path, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=96,
                 pool_layout=pool_layout, kv_dtype=kv_dtype)  # fmt: skip


def pages_of(index: int, length: int) -> list[int]:
    return scattered_pages(index, -(-length // PAGE_SIZE))


def planes(kv_cache, layer: int, pages: list[int], length: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """The layer's K and V (or latent) rows of positions [0, length), as stored."""
    pools = (kv_cache.k[layer],) + ((kv_cache.v[layer],) if kv_cache.v else ())
    return [torch.cat([pool[p] for p in pages])[:length] for pool in pools]


def run_whole(runner) -> None:  # type: ignore[no-untyped-def]
    chunks = [chunk(f"r{i}", ids, 0, len(ids), pages_of(i, len(ids)), True)
              for i, ids in enumerate(IDS)]  # fmt: skip
    runner.run(plan(*chunks))


@pytest.mark.parametrize("pool_layout", ["layer_major", "page_major"])
def test_pool_bytes_are_the_kv_cast_to_e4m3(checkpoint, pool_layout):
    family, path = checkpoint
    if family == "deepseek_v3" and pool_layout == "page_major":
        pytest.skip("an MLA pool has one layout")
    runner, fp8_cache, info = ours(path, "fp8_e4m3", pool_layout)
    plain_runner, plain_cache, _ = ours(path, "auto", pool_layout)
    assert fp8_cache.layout.dtype == "fp8_e4m3" and fp8_cache.k[0].dtype == E4M3
    assert info.dtype == "fp8_e4m3"  # what /readyz and the transfer describe
    run_whole(runner)
    run_whole(plain_runner)
    model = hf_model(path)
    for i, ids in enumerate(IDS):
        pages = pages_of(i, len(ids))
        _, hf_kv = (hf_mla_forward if family == "deepseek_v3" else hf_forward)(model, ids)
        for layer, expected in enumerate(hf_kv):
            got = planes(fp8_cache, layer, pages, len(ids))
            plain = planes(plain_cache, layer, pages, len(ids))
            wanted = [expected[:, None]] if family == "deepseek_v3" else list(expected)
            for stored, ours_plain, theirs in zip(got, plain, wanted, strict=True):
                assert torch.equal(stored.view(torch.uint8), ours_plain.to(E4M3).view(torch.uint8))
                assert_adjacent(stored, theirs.to(E4M3))


def assert_adjacent(stored: torch.Tensor, wanted: torch.Tensor) -> None:
    """transformers' K/V cast alike: equal bytes, except where its float32 values and ours
    (within 1e-4) straddle a rounding boundary: the adjacent e4m3 code, at most 1 in 1000."""
    got, want = (t.view(torch.uint8).to(torch.int16) for t in (stored, wanted))
    differ = got != want
    assert ((got - want).abs()[differ] == 1).all()
    assert int(differ.sum()) <= got.numel() // 1000


def test_a_later_chunk_reads_the_fp8_pages_back(checkpoint):
    """Chunk 2 of a prompt attends over chunk 1's FP8 pages (and its own fresh K/V, as
    SGLang's prefill does): its logits equal a run over a float32 pool into which chunk 1's
    K/V were written rounded through e4m3."""
    _, path = checkpoint
    ids, pages = IDS[0], pages_of(0, len(IDS[0]))
    first, second = chunk("a", ids, 0, 32, pages, False), chunk("a", ids, 32, 45, pages, True)
    runner, _, _ = ours(path, "fp8_e4m3")
    runner.run(plan(first))
    got = runner.compute_logits(plan(second))[0]
    plain_runner, plain_cache, _ = ours(path, "auto")
    plain_runner.run(plan(first))
    exact = plain_runner.compute_logits(plan(second))[0]
    for pool in (*plain_cache.k, *plain_cache.v):  # chunk 1's rows, rounded as FP8 stores them
        pool[pages[:2]] = pool[pages[:2]].to(E4M3).float()
    rounded = plain_runner.compute_logits(plan(second))[0]
    torch.testing.assert_close(got, rounded, atol=1e-4, rtol=0)
    assert (got - exact).abs().max() > 1e-3  # the rounding was read, not the fresh values


def test_the_layout_says_fp8_and_a_bf16_peer_does_not_match():
    fp8 = KVLayout(2, 2, 32, "fp8_e4m3", 16, 8)
    bf16 = KVLayout(2, 2, 32, "bfloat16", 16, 8)
    assert fp8.page_bytes * 2 == bf16.page_bytes == 16 * 2 * 32 * 2
    assert fp8.compat_hash() != bf16.compat_hash()
    assert fp8.summary()["dtype"] == "fp8_e4m3"


def test_flashinfer_cannot_read_fp8_back():
    check_kv_backend("fp8_e4m3", "sdpa")
    check_kv_backend("bfloat16", "flashinfer")
    with pytest.raises(ValueError, match="read back by the sdpa attention backend only"):
        check_kv_backend("fp8_e4m3", "flashinfer")
