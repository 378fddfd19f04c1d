"""A follower's share of vLLM staging at TP > 1 (``service.vllm_group``): a rank whose head is
another rank's replica writes nothing (its runner drops the mirror slots, its stages copy
nothing), one with heads copies its stages into its heads of the shared blocks."""

from __future__ import annotations

import numpy as np
import torch

from prefill_worker.batch import BatchOutput, BatchPlan, ChunkPlan
from prefill_worker.kv.layout import VLLM_BLOCKS, KVLayout
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.service.vllm_group import FollowerStaging, Unmirrored, _attach
from prefill_worker.transfer.vllm.shared import GroupStaging, Stage
from prefill_worker.transfer.vllm.staging import StagingLayout, StagingPool

L, D, PS, PAGES, BS = 2, 4, 4, 8, 8


class Recording:
    def __init__(self) -> None:
        self.plans: list[BatchPlan] = []

    def run(self, plan: BatchPlan) -> BatchOutput:
        self.plans.append(plan)
        return BatchOutput(plan.batch_id, ())


def test_a_replica_rank_runs_the_forward_without_mirror_slots() -> None:
    inner = Recording()
    chunk = ChunkPlan("a", (1, 2), 0, 2, (3,), None, mirror_slots=(8, 9))
    Unmirrored(inner).run(BatchPlan(4, (chunk,)))
    (plan,) = inner.plans
    assert plan.batch_id == 4 and plan.chunks[0].mirror_slots == ()
    assert plan.chunks[0].page_ids == (3,) and tuple(plan.chunks[0].token_ids) == (1, 2)


def _follower(heads: range | None) -> tuple[KVCache, StagingPool, FollowerStaging]:
    kv = KVCache(KVLayout(L, 1, D, "float32", PS, PAGES), torch.device("cpu"))
    for layer in range(L):
        slots = torch.arange(PAGES * PS)
        kv.write(layer, slots, torch.randn(PAGES * PS, 1, D), torch.randn(PAGES * PS, 1, D))
    staging = StagingPool(StagingLayout(L, 2, D, 4, BS, 3))  # the group's 2 heads
    return kv, staging, FollowerStaging(kv, staging, heads)


def test_a_rank_copies_its_stages_into_its_heads_only() -> None:
    kv, staging, follower = _follower(range(1, 2))
    follower.apply([Stage([5, 2], 0, [2], 0, 6)])  # 6 tokens: page 5, then 2 of page 2
    block = torch.from_numpy(staging.layer_view(1)[2].view(np.float32))  # [2 heads, BS, 2D]
    want_k = torch.cat([kv.k[1][5, :, 0], kv.k[1][2, :2, 0]])  # [6, D]
    assert torch.equal(block[1, :6, :D], want_k)
    assert not block[0].any() and not block[1, 6:].any()  # head 0 is rank 0's


def test_a_replica_rank_copies_nothing() -> None:
    _, staging, follower = _follower(None)
    follower.apply([Stage([5, 2], 0, [2], 0, 6)])
    assert not any(staging.layer_view(i).any() for i in range(L))


def test_a_vllm_blocks_rank_moves_its_pool_into_its_heads_and_mirrors_nothing() -> None:
    """At TP > 1 a vllm_blocks pool is the region the group shares (``_attach``): the rank's
    pool becomes its heads of it, no KV mirror; a replica rank keeps its own pool."""
    lay = KVLayout(L, 1, D, "float32", BS, PAGES, VLLM_BLOCKS)
    region = StagingLayout(L, 2, D, 4, BS, PAGES)
    buffer = np.zeros(L * region.region_bytes, np.uint8)
    kv = KVCache(lay, torch.device("cpu"))
    _attach(kv, region, GroupStaging(buffer, 2, range(1, 2)))
    assert not kv.has_mirror
    kv.write(0, torch.tensor([BS + 2]), torch.ones(1, 1, D), torch.ones(1, 1, D))
    block = torch.from_numpy(buffer[: region.region_bytes].view(np.float32)).view(
        PAGES, 2, BS, 2 * D
    )
    assert torch.equal(block[1, 1, 2], torch.ones(2 * D)) and int((block != 0).sum()) == 2 * D
    replica = KVCache(lay, torch.device("cpu"))
    _attach(replica, region, GroupStaging(buffer, 2, None))
    replica.write(0, torch.tensor([0]), torch.ones(1, 1, D), torch.ones(1, 1, D))
    assert int((block != 0).sum()) == 2 * D and not replica.has_mirror
