"""A ``vllm_blocks`` pool (``model.kv_cache``): its storage is vLLM's LBHNC blocks, and the K/V
views the runner and attention use are strided views of that storage, so ``KVCache.write``
lands each token's K and V where a vLLM decode reads its block (checked against a reshape of
the written values), and a gather through the views (sdpa's prefix read) gives them back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import VLLM_BLOCKS, KVLayout
from prefill_worker.model.kv_cache import KVCache

L, H, D, PS, PAGES = 2, 3, 4, 8, 5


def test_writes_land_in_lbhnc_blocks_and_read_back_through_the_views() -> None:
    cache = KVCache(KVLayout(L, H, D, "float32", PS, PAGES, VLLM_BLOCKS), torch.device("cpu"))
    slots = torch.tensor([3 * PS + 7, 1 * PS + 0, 1 * PS + 5])  # pages 3, 1, 1
    k, v = torch.randn(L, 3, H, D), torch.randn(L, 3, H, D)
    for layer in range(L):
        cache.write(layer, slots, k[layer], v[layer])
    storage = cache._storage  # [L, P, H, PS, 2D]
    assert storage.shape == (L, PAGES, H, PS, 2 * D) and storage.is_contiguous()
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, PS)
        for layer in range(L):
            assert torch.equal(storage[layer, page, :, offset, :D], k[layer, i])
            assert torch.equal(storage[layer, page, :, offset, D:], v[layer, i])
    assert int((storage != 0).sum()) == L * 3 * H * 2 * D  # nothing else written
    pages, offsets = slots // PS, slots % PS
    for layer in range(L):
        assert torch.equal(cache.k[layer][pages, offsets], k[layer])
        assert torch.equal(cache.v[layer][pages, offsets], v[layer])
        assert cache.k[layer].shape == (PAGES, PS, H, D)
    # one page of one layer is one contiguous run at k_base_addrs[l] + p * page_stride_bytes
    lay = cache.layout
    run = storage[1, 3].contiguous().view(-1)
    at = cache.k_base_addrs[1] + 3 * lay.page_stride_bytes
    assert storage[1, 3].data_ptr() == at and run.numel() * 4 == lay.region_page_bytes
    assert cache.v_base_addrs[1] == cache.k_base_addrs[1] + D * 4


def test_tensor_parallel_ranks_share_one_pool_each_its_heads() -> None:
    """At TP > 1 every rank's pool moves into its heads of one buffer (``share_storage``,
    ``service.vllm_group``): what each held is kept, and each rank's writes land in its heads
    of the group's LBHNC blocks, nowhere else."""
    lay = KVLayout(L, 1, D, "float32", PS, PAGES, VLLM_BLOCKS)  # a rank's one head of two
    buffer = np.zeros(L * PAGES * 2 * PS * 2 * D * 4, np.uint8)
    ranks = [KVCache(lay, torch.device("cpu")) for _ in range(2)]
    ranks[1]._storage.fill_(3.0)  # held before the move: kept
    for r, cache in enumerate(ranks):
        cache.share_storage(buffer, 2, range(r, r + 1))
    group = torch.from_numpy(buffer).view(torch.float32).view(L, PAGES, 2, PS, 2 * D)
    assert torch.all(group[:, :, 0] == 0) and torch.all(group[:, :, 1] == 3.0)
    slots = torch.tensor([2 * PS + 1])
    for r, cache in enumerate(ranks):
        kv = torch.full((1, 1, D), float(10 + r))
        cache.write(1, slots, kv, -kv)
        assert torch.equal(cache.k[1][2, 1], kv[0]) and torch.equal(cache.v[1][2, 1], -kv[0])
    assert torch.equal(group[1, 2, :, 1, :D], torch.tensor([[10.0] * D, [11.0] * D]))
    assert torch.equal(group[1, 2, :, 1, D:], -torch.tensor([[10.0] * D, [11.0] * D]))
    with pytest.raises(ValueError, match="into heads"):
        ranks[0].share_storage(buffer, 2, range(0, 2))
