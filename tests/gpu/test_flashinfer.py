"""The flashinfer backend against the sdpa reference on CUDA (skipped without one)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from prefill_worker.model.attention import AttentionBatch, create_backend
from tests.attention_batches import scattered_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed"
    ),
]

PAGE_SIZE, NUM_PAGES, HEADS, KV_HEADS = 16, 64, 8, 2


def _batch(chunks: list[tuple[int, int]]) -> tuple[AttentionBatch, torch.Tensor]:
    return scattered_batch(chunks, PAGE_SIZE, NUM_PAGES)


@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_sdpa(dtype, dim):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    # fresh prompt, a chunk after a cached prefix, a one-token chunk
    batch, slots = _batch([(0, 100), (128, 200), (40, 41)])
    pool_shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, dim)
    k_pool = torch.randn(pool_shape, generator=gen, device=device, dtype=dtype)
    v_pool = torch.randn(pool_shape, generator=gen, device=device, dtype=dtype)
    num_tokens = batch.num_tokens
    q = torch.randn(num_tokens, HEADS, dim, generator=gen, device=device, dtype=dtype) * 3
    slots = slots.to(device)
    k = k_pool.view(-1, KV_HEADS, dim)[slots]  # this batch's K/V, already in its pages
    v = v_pool.view(-1, KV_HEADS, dim)[slots]
    outputs = {}
    for name in ("sdpa", "flashinfer"):
        backend = create_backend(name, device)
        backend.plan(batch)
        outputs[name] = torch.empty_like(q)
        backend.attend(q, k, v, k_pool, v_pool, outputs[name])
    torch.testing.assert_close(outputs["flashinfer"], outputs["sdpa"], atol=2e-2, rtol=2e-2)


def test_flashinfer_reads_page_major_views_in_place():
    """A page-major pool's per-layer views are strided (pages 2L layer-pages apart): both
    backends read them as they are and agree with a contiguous copy of the same layer."""
    device, dtype, dim, num_layers = torch.device("cuda"), torch.bfloat16, 64, 3
    gen = torch.Generator(device=device).manual_seed(1)
    batch, slots = _batch([(0, 100), (128, 200), (40, 41)])
    shape = (NUM_PAGES, num_layers, 2, PAGE_SIZE, KV_HEADS, dim)
    pool = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    k_pool, v_pool = pool[:, 1, 0], pool[:, 1, 1]  # layer 1: strided views, no copy
    assert not k_pool.is_contiguous() and k_pool.stride() == v_pool.stride()
    q = torch.randn(batch.num_tokens, HEADS, dim, generator=gen, device=device, dtype=dtype)
    slots = slots.to(device)
    rows = (slots // PAGE_SIZE, slots % PAGE_SIZE)
    k, v = k_pool[rows], v_pool[rows]
    outputs = {}
    for name, pools in [
        ("flashinfer", (k_pool, v_pool)),
        ("sdpa", (k_pool, v_pool)),
        ("contiguous", (k_pool.contiguous(), v_pool.contiguous())),
    ]:
        backend = create_backend("sdpa" if name == "contiguous" else name, device)
        backend.plan(batch)
        outputs[name] = torch.empty_like(q)
        backend.attend(q, k, v, *pools, outputs[name])
    torch.testing.assert_close(outputs["sdpa"], outputs["contiguous"], atol=0, rtol=0)
    torch.testing.assert_close(outputs["flashinfer"], outputs["sdpa"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pool_layout", ["layer_major", "page_major"])
def test_runner_with_flashinfer_matches_sdpa(tmp_path, pool_layout):
    """The whole model on CUDA: chunked prefill with each backend, same logits and pages."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from prefill_worker.batch import BatchPlan, ChunkPlan
    from prefill_worker.model import build
    from prefill_worker.request import SamplingParams

    config = Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (150,)).tolist()
    pages = list(range(30, 0, -3))
    results = {}
    for name in ("sdpa", "flashinfer"):
        runner, kv_cache, _ = build(
            tmp_path, "bfloat16", "cuda", name, PAGE_SIZE, num_pages=32, pool_layout=pool_layout
        )
        first = ChunkPlan("a", ids[:64], 0, 64, pages, None)
        runner.compute_logits(BatchPlan(0, (first,)))
        last = ChunkPlan("a", ids[64:], 64, 150, pages, SamplingParams())
        other = ChunkPlan("b", ids[:37], 0, 37, [31, 29, 28], SamplingParams())
        logits = runner.compute_logits(BatchPlan(1, (other, last)))
        results[name] = (logits.float(), kv_cache.k[1][list(pages)].float())
    torch.testing.assert_close(results["flashinfer"][0], results["sdpa"][0], atol=5e-2, rtol=0)
    torch.testing.assert_close(results["flashinfer"][1], results["sdpa"][1], atol=5e-2, rtol=0)


def test_auto_picks_flashinfer_on_cuda():
    from prefill_worker.model.attention import resolve_backend_name

    assert resolve_backend_name("auto", torch.device("cuda")) == "flashinfer"
    assert resolve_backend_name("auto", torch.device("cpu")) == "sdpa"
