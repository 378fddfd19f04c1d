"""The windowed sliding pool (``cache.sliding_pool: windowed``, ``kv.sliding``) through our
runner against ``transformers``: gpt-oss and Gemma 3 on their tiny random fp32 checkpoints
(window 24), two prompts longer than the window (150 and 61 tokens) prefilled together in
chunks of 16 whose pages go back to a sliding pool of two requests' quotas after each chunk,
so later chunks write into pages earlier positions held. The last token's logits, the prompt
logprobs, every full layer's K/V at every position (its own pool) and every sliding layer's
over the last ``window - 1`` positions (read through the request's sliding entries) equal
transformers' within 1e-4, and both pools are whole afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import SlidingPageTable, sliding_pool_pages
from prefill_worker.model import build
from prefill_worker.request import SamplingParams
from prefill_worker.transfer.nixl.agent import region_tables
from prefill_worker.transfer.pagemap import layer_view_table
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.model.conftest import (
    NUM_PAGES,
    PAGE_SIZE,
    hf_forward,
    paged_kv,
    plan,
    scattered_pages,
)

TOL = 1e-4
WINDOW = 24
CHUNK = 16


@pytest.fixture(scope="module", params=["gpt_oss", "gemma3"])
def family(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")
    return path, hf_model(path)


def windowed(path: Path, num_requests: int):  # type: ignore[no-untyped-def]
    pages = sliding_pool_pages(WINDOW, CHUNK, PAGE_SIZE, num_requests)
    runner, kv_cache, info = build(
        path, dtype="float32", page_size=PAGE_SIZE, num_pages=NUM_PAGES, sliding_pages=pages
    )
    table = SlidingPageTable(PagePool(pages), PAGE_SIZE, WINDOW, CHUNK)
    return runner, kv_cache, info, table


def chunk_of(rid: str, ids: list[int], start: int, pages, table) -> ChunkPlan:  # type: ignore[no-untyped-def]
    end = min(start + CHUNK, len(ids))
    last = end == len(ids)
    return ChunkPlan(
        rid,
        ids[start:end],
        start,
        end,
        pages,
        SamplingParams() if last else None,
        start,
        tuple(ids[start + 1 : end + 1]),
        sliding_page_ids=table.pages_for(rid, start, end),
    )


def test_chunks_over_a_reused_sliding_pool_match_transformers(family):
    path, hf = family
    runner, kv_cache, info, table = windowed(path, num_requests=2)
    sliding = info.sliding_layers
    prompts = {"a": prompt(150, seed=5), "b": prompt(61, seed=6)}
    full_pages = {rid: scattered_pages(i, -(-len(ids) // PAGE_SIZE)) for i, (rid, ids) in
                  enumerate(prompts.items())}  # fmt: skip
    for rid, ids in prompts.items():
        assert table.try_reserve(rid, len(ids))
    progress, previous = dict.fromkeys(prompts, 0), {}
    logprobs: dict[str, list[float]] = {rid: [] for rid in prompts}
    sampled = {}
    while progress:
        chunks = [chunk_of(r, prompts[r], s, full_pages[r], table) for r, s in progress.items()]
        for rid, end in previous.items():  # the previous forward is consumed after the plan
            table.chunk_done(rid, end)
        out = runner.run(plan(*chunks))
        for lp in out.prompt_logprobs:
            logprobs[lp.request_id] += lp.logprobs
        sampled.update({t.request_id: t for t in out.sampled})
        previous = {c.request_id: c.end for c in chunks}
        progress = {c.request_id: c.end for c in chunks if c.end < len(prompts[c.request_id])}
    for rid, end in previous.items():
        table.chunk_done(rid, end)
    assert table.pool.num_used < sum(-(-len(p) // PAGE_SIZE) for p in prompts.values())
    for rid, ids in prompts.items():
        logits, kv = hf_forward(hf, ids)
        for layer, (k_ref, v_ref) in enumerate(kv):
            pages = table.get(rid) if layer in sliding else full_pages[rid]
            kept = k_ref.shape[0]  # a sliding layer: transformers keeps window - 1
            first = (len(ids) - kept) // PAGE_SIZE
            k, v = paged_kv(kv_cache, list(pages[first:]), len(ids) - first * PAGE_SIZE, layer)
            torch.testing.assert_close(k[-kept:], k_ref, atol=TOL, rtol=1e-5)
            torch.testing.assert_close(v[-kept:], v_ref, atol=TOL, rtol=1e-5)
        assert sampled[rid].token_id == int(logits[-1].argmax())
        assert sampled[rid].logprob == pytest.approx(float(logits[-1].log_softmax(-1).max()),
                                                     abs=TOL)  # fmt: skip
        expected = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs[rid]), expected, atol=TOL, rtol=0)
        table.release(rid)
    assert table.pool.num_free == table.pool.num_pages
    table.check_integrity()


def test_a_windowed_pool_holds_the_sliding_layers_apart(family):
    """The full layers' storage holds only them; the sliding layers' storage its own pages;
    its transfer regions each of its own page count; a chunk without sliding entries is refused."""
    path, _ = family
    runner, kv_cache, info, table = windowed(path, num_requests=1)
    full = [i for i in range(info.num_layers) if i not in info.sliding_layers]
    assert {kv_cache.k[i].shape[0] for i in full} == {NUM_PAGES}
    assert {kv_cache.k[i].shape[0] for i in info.sliding_layers} == {table.pool.num_pages}
    layer_bytes = 2 * kv_cache.layout.page_bytes
    assert kv_cache.num_bytes == layer_bytes * (
        len(full) * NUM_PAGES + len(info.sliding_layers) * table.pool.num_pages
    )
    regions = kv_cache.regions(0, 1)  # the sliding layers: regions of their own page count
    num_sliding = table.pool.num_pages
    want = tuple(
        num_sliding if i in info.sliding_layers else NUM_PAGES
        for i in range(len(full) + len(info.sliding_layers))
    )
    assert regions.layer_pages == want and regions.region_num_pages == want * 2
    assert regions.k_base_addrs == tuple(k.data_ptr() for k in kv_cache.k)
    rows = layer_view_table(regions)  # what a transfer lists: each region's own page count
    assert [int(r[4]) for r in rows] == list(want * 2)
    kv_rows, _ = region_tables(regions)  # and registers: each region's own bytes
    assert [int(r[1]) for r in kv_rows] == [n * kv_cache.layout.page_bytes for n in want * 2]
    assert regions.region_offsets[len(full) + len(info.sliding_layers)] == sum(want)
    budget = kv_cache.num_bytes + 5 * layer_bytes * len(full)  # room for 5 more full pages
    _, sized, _ = build(
        path, dtype="float32", page_size=PAGE_SIZE, num_pages=None, memory_bytes=budget,
        sliding_pages=table.pool.num_pages,
    )  # fmt: skip
    assert sized.layout.num_pages == NUM_PAGES + 5  # the sliding pool's bytes taken first
    ids = prompt(40, seed=1)
    bare = ChunkPlan("a", ids[:16], 0, 16, scattered_pages(0, 3), None)
    with pytest.raises(ValueError, match=r"sliding pages 0\.\.0 needed"):
        runner.run(plan(bare))
