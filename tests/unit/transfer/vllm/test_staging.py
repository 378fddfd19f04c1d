"""The vLLM staging repack: our pool's pages, in either layout and at a page size other than
vLLM's block size, land in LBHNC blocks byte for byte (checked against torch's own reshape)."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.kv.layout import (
    LAYER_MAJOR,
    MLA,
    PAGE_MAJOR,
    VLLM_BLOCKS,
    KVLayout,
    KVRegions,
)
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.transfer.vllm.staging import (
    PoolViews,
    StagingPool,
    StagingRefused,
    repack,
    staging_layout,
)

L, H, D, PAGES = 3, 2, 8, 40


def _pool(
    kind: str, page_size: int, is_uneven: bool = False
) -> tuple[torch.Tensor, KVRegions, torch.Tensor]:
    """A random bf16 pool: its values as a [L, 2, pages, ps, H, D] view, its regions, and the
    tensor the regions point into (keep it alive). ``is_uneven``: layer-major with the layers
    out of order in memory (no common stride between them)."""
    lay = KVLayout(L, H, D, "bfloat16", page_size, PAGES, kind)
    if kind == LAYER_MAJOR:
        t = torch.randn(L, 2, PAGES, page_size, H, D).to(torch.bfloat16)
        order = [2, 0, 1] if is_uneven else list(range(L))
        view = t[order]
        k = tuple(t[j, 0].data_ptr() for j in order)
        v = tuple(t[j, 1].data_ptr() for j in order)
    elif kind == VLLM_BLOCKS:  # the runner's own pool: [L, P, H, ps, 2D]
        cache = KVCache(lay, torch.device("cpu"))
        cache._storage.copy_(torch.randn(cache._storage.shape).to(torch.bfloat16))
        t = cache._storage
        view = torch.stack([torch.stack([k, v]) for k, v in zip(cache.k, cache.v, strict=True)])
        k, v = cache.k_base_addrs, cache.v_base_addrs
    else:
        t = torch.randn(PAGES, L, 2, page_size, H, D).to(torch.bfloat16)
        view = t.permute(1, 2, 0, 3, 4, 5)
        k = tuple(t[0, i, 0].data_ptr() for i in range(L))
        v = tuple(t[0, i, 1].data_ptr() for i in range(L))
    return view, KVRegions(lay, k, v, "cpu", 0, 0), t


def _expected(view: torch.Tensor, page_ids: list[int], n: int, bs: int) -> torch.Tensor:
    """[L, blocks, H, bs, 2D]: the request's tokens in vLLM's layout (zero past the prompt)."""
    per_token = view[:, :, page_ids].flatten(2, 3)[:, :, :n]  # [L, 2, n, H, D]
    blocks = -(-n // bs)
    out = torch.zeros(L, blocks * bs, H, 2 * D, dtype=view.dtype)
    out[:, :n, :, :D], out[:, :n, :, D:] = per_token[:, 0], per_token[:, 1]
    return out.view(L, blocks, bs, H, 2 * D).transpose(2, 3)


@pytest.mark.parametrize(
    ("kind", "page_size", "n", "chunk", "is_uneven"),
    [
        (LAYER_MAJOR, 16, 100, 3, False),
        (PAGE_MAJOR, 64, 70, 1, False),
        (LAYER_MAJOR, 16, 100, 3, True),
        (VLLM_BLOCKS, 16, 100, 3, False),  # strided K/V views (a TP > 1 worker stages it)
    ],
)
def test_repack_in_chunks_matches_lbhnc(
    kind: str, page_size: int, n: int, chunk: int, is_uneven: bool
) -> None:
    """Evenly spaced layers take the one-copy-per-piece path, uneven ones the per-layer path;
    chunks of three 16-token pages end mid-block and cross block ends, pages of 64 span two
    blocks, and the last block is partly filled."""
    view, regions, _storage = _pool(kind, page_size, is_uneven)
    assert (PoolViews(regions).kv is None) is is_uneven
    staging = StagingPool(staging_layout(regions, block_size=32, num_blocks=12))
    staging.try_allocate(1)  # the request's blocks are not the first ones
    num_pages = -(-n // page_size)
    page_ids = [PAGES - 1 - 3 * i for i in range(num_pages)]  # scattered, descending
    blocks = staging.try_allocate(-(-n // 32))
    assert blocks is not None
    pool = PoolViews(regions)
    copied = 0
    for first in range(0, num_pages, chunk):  # chunk by chunk, as the engine hands them over
        tokens = range(first * page_size, min((first + chunk) * page_size, n))
        copied += repack(pool, staging, page_ids[first : first + chunk], first, blocks, tokens)
    assert copied == n * L * H * 2 * D * 2
    got = torch.stack([torch.from_numpy(staging.layer_view(i)[list(blocks)]) for i in range(L)])
    want = _expected(view, page_ids, n, 32).view(torch.int16)
    assert torch.equal(got.view(torch.int16)[..., :], want)


def test_allocation_is_all_or_nothing_and_returns_whole() -> None:
    _, regions, _storage = _pool(LAYER_MAJOR, 16)
    staging = StagingPool(staging_layout(regions, block_size=32, num_blocks=4))
    first = staging.try_allocate(3)
    assert first == (0, 1, 2)
    assert staging.try_allocate(2) is None and staging.num_free == 1
    staging.free(first)
    assert staging.num_free == 4


def test_blocks_come_lowest_first_and_ascending_after_frees() -> None:
    """Blocks freed in any order come back as one ascending run: NIXL merges only descriptors
    adjacent in order, so a reversed run would cost a READ one descriptor per block."""
    _, regions, _storage = _pool(LAYER_MAJOR, 16)
    staging = StagingPool(staging_layout(regions, block_size=32, num_blocks=12))
    first, second = staging.try_allocate(4), staging.try_allocate(4)
    assert first == (0, 1, 2, 3) and second == (4, 5, 6, 7)
    staging.free(second)
    staging.free(first)
    assert staging.try_allocate(8) == tuple(range(8))
    staging.free((6, 2, 4))
    assert staging.try_allocate(2) == (2, 4) and staging.num_free == 5


def test_mla_and_device_pools_are_refused() -> None:
    mla = KVLayout(2, 1, 8, "bfloat16", 16, 4, MLA)
    with pytest.raises(StagingRefused, match="mla"):
        staging_layout(KVRegions(mla, (1, 2), (), "cpu", 0, 0), 32, 4)
    _, regions, _storage = _pool(LAYER_MAJOR, 16)
    gpu = KVRegions(regions.layout, regions.k_base_addrs, regions.v_base_addrs, "cuda:0", 0, 0)
    with pytest.raises(StagingRefused, match="host"):
        staging_layout(gpu, 32, 4)


def test_each_rank_repacks_its_heads_into_the_shared_blocks() -> None:
    """At TP 2 each rank's pool holds one of the two heads: rank 1's repack writes head 1 of
    the blocks and leaves head 0 alone; with rank 0's too the blocks are the whole model's."""
    view, regions, _storage = _pool(LAYER_MAJOR, 16)
    shared = StagingPool(staging_layout(regions, block_size=32, num_blocks=4))
    page_ids, n = [7, 3, 30], 40
    blocks = shared.try_allocate(2)
    assert blocks is not None
    rank_pools = []
    for rank in (1, 0):
        t = view[..., rank : rank + 1, :].contiguous()  # [L, 2, pages, ps, 1, D]
        lay = KVLayout(L, 1, D, "bfloat16", 16, PAGES, LAYER_MAJOR)
        k = tuple(t[i, 0].data_ptr() for i in range(L))
        v = tuple(t[i, 1].data_ptr() for i in range(L))
        rank_pools.append(t)
        heads = range(rank, rank + 1)
        pool = PoolViews(KVRegions(lay, k, v, "cpu", 0, 0))
        repack(pool, shared, page_ids, 0, blocks, range(0, n), heads)
        got = torch.stack([torch.from_numpy(shared.layer_view(i)[list(blocks)]) for i in range(L)])
        want = _expected(view, page_ids, n, 32).view(torch.int16)
        assert torch.equal(got.view(torch.int16)[:, :, rank], want[:, :, rank])
        if rank == 1:
            assert not got.view(torch.int16)[:, :, 0].any()  # rank 0's head: not yet written
    assert torch.equal(got.view(torch.int16), want)
