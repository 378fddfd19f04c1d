"""Fixtures for runner-vs-transformers tests: tiny random checkpoints of every family
(``tests/checkpoints.py``), our runner over them, and paged-KV helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.parallel import SINGLE
from prefill_worker.request import SamplingParams
from tests.checkpoints import FAMILIES, hf_model, make_checkpoint, prompt

__all__ = ["FAMILIES", "hf_model", "prompt"]  # re-exported for the tests here

PAGE_SIZE = 16
NUM_PAGES = 96


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_checkpoint(f, root / f, sharded=f == "qwen2") for f in FAMILIES}


def hf_forward(model: torch.nn.Module, ids: list[int]):  # type: ignore[no-untyped-def]
    """(logits [S, vocab] fp32, [(k, v)] per layer each [S, KV, D])."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    kv = [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in out.past_key_values.layers
    ]
    return out.logits[0].float(), kv


def hf_mla_forward(model: torch.nn.Module, ids: list[int]):  # type: ignore[no-untyped-def]
    """(logits [S, vocab] fp32, per layer the MLA pool rows [S, r + rope] transformers'
    cache implies: its ``keys`` (the normalised latent), then its ``values`` (the roped key
    part) put in SGLang's interleaved order, as our pool holds them)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    rows = []
    for layer in out.past_key_values.layers:
        rope = layer.values[0, 0]  # [S, rope]: the rotated even elements, then the odd ones
        half = rope.shape[-1] // 2
        interleaved = torch.stack([rope[:, :half], rope[:, half:]], -1).flatten(-2)
        rows.append(torch.cat([layer.keys[0, 0], interleaved], dim=-1))
    return out.logits[0].float(), rows


def hf_index_keys(model, ids: list[int]) -> dict[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """transformers' DSA index keys ``[S, Di]`` per indexed layer, in our pool's order (its
    interleaved-rope indexer's rotated even elements first, then the odd ones; ours in place)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    interleave, rope = model.config.model_type == "glm_moe_dsa", model.config.qk_rope_head_dim
    keys = {}
    for layer, cached in enumerate(out.past_key_values.layers):
        if not cached.is_indexer_initialized:
            continue  # a shared layer: no indexer
        k = cached.indexer_keys[0].clone()  # [S, Di]
        if interleave:
            rot = k[:, :rope]
            k[:, :rope] = torch.stack([rot[:, : rope // 2], rot[:, rope // 2 :]], -1).flatten(-2)
        keys[layer] = k
    return keys


def ours(path: Path, dtype: str = "float32", pool_layout: str = "layer_major", tp=SINGLE):  # type: ignore[no-untyped-def]
    return build(
        path,
        dtype=dtype,
        device="cpu",
        page_size=PAGE_SIZE,
        pool_layout=pool_layout,
        num_pages=NUM_PAGES,
        tp=tp,
    )


def scattered_pages(first: int, count: int) -> list[int]:
    """Non-contiguous, descending page ids, so page indexing bugs show."""
    return [NUM_PAGES - 1 - first - 3 * i for i in range(count)]


def chunk(
    request_id: str, ids: list[int], start: int, end: int, pages: list[int], last: bool
) -> ChunkPlan:
    sampling = SamplingParams() if last else None
    return ChunkPlan(request_id, ids[start:end], start, end, pages, sampling)


def plan(*chunks: ChunkPlan) -> BatchPlan:
    return BatchPlan(batch_id=0, chunks=tuple(chunks))


def paged_kv(kv_cache, pages: list[int], length: int, layer: int):  # type: ignore[no-untyped-def]
    """K and V of positions [0, length) gathered from the pool: ``[length, KV, D]`` each."""
    k = torch.cat([kv_cache.k[layer][p] for p in pages])[:length]
    v = torch.cat([kv_cache.v[layer][p] for p in pages])[:length]
    return k, v
