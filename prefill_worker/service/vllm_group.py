"""Start-up of vLLM pulls at TP > 1: the staging region every rank of the group shares
(``transfer/vllm/shared.py``; docs/vllm.md, "Workers with TP > 1").

Once every rank has loaded (``agree_loaded``), and before the first step, the leader creates
the region, sends its path to the followers (a broadcast on the default group, as the load
barrier is), each follower maps it and attaches its heads of it as its pool's KV mirror (a
``vllm_blocks`` pool instead moves into its heads of it: the region is the group's pool, no
mirror, nothing staged; docs/vllm.md, "A pool in vLLM's layout"), and
one all-reduce says every rank has: then the leader unlinks the file. A follower then runs
the stages of the leader's repacks that each step carries, for its heads
(``FollowerStaging``). The leader's vLLM
backend registers the region with its NIXL agent later (``startup.start_transfer``). Every
rank decides whether to take part from the same facts (``transfer.protocol`` has vllm, the
pool is in host memory), so the collectives pair up; a pool that cannot be staged (MLA) is
refused on every rank alike, before any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner
from prefill_worker.kv.layout import VLLM_BLOCKS
from prefill_worker.model.kv_cache import TORCH_DTYPES, KVCache
from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.service.config import Config
from prefill_worker.service.startup import startup_step
from prefill_worker.tp.channel import LeaderChannel
from prefill_worker.transfer.vllm.direct import is_direct
from prefill_worker.transfer.vllm.shared import GroupStaging, SharedRegion, Stage, writer_heads
from prefill_worker.transfer.vllm.staging import (
    PoolViews,
    StagingLayout,
    StagingPool,
    repack,
    staging_layout,
)

_PATH_BYTES = 4096  # the broadcast's fixed size: a path, NUL-padded


def _layout(config: Config, kv_cache: KVCache, num_kv_heads: int) -> StagingLayout | None:
    """The shared region's shape, or None where this group stages nothing. A ``vllm_blocks``
    pool: the group's pool itself, every rank's heads of every page (``_share``)."""
    regions = kv_cache.regions(0, 0)
    if "vllm" not in config.transfer.protocols or regions.device != "cpu":
        return None  # a device pool: the leader's vLLM backend refuses it (exit 78)
    cfg = config.transfer
    if is_direct(regions):
        lay = regions.layout
        return staging_layout(regions, lay.page_size, lay.num_pages, num_kv_heads)
    return staging_layout(regions, cfg.vllm_block_size, cfg.vllm_staging_blocks, num_kv_heads)


def lead_staging(
    config: Config, kv_cache: KVCache, num_kv_heads: int, tp_size: int, channel: LeaderChannel
) -> GroupStaging | None:
    """The leader's side (rank 0): the region made, shared, and its heads mirrored; the
    followers' repacks go on ``channel``'s steps."""
    with startup_step("vllm shared staging", (ValueError,)):
        layout = _layout(config, kv_cache, num_kv_heads)
        if layout is None:
            return None
        region = SharedRegion(layout.num_layers * layout.region_bytes)
        try:
            assert region.path is not None
            _broadcast_path(region.path)
            if not _all_mapped(True):
                raise ValueError("a tensor-parallel rank could not map the vLLM staging region")
        finally:
            region.unlink()
        heads = writer_heads(num_kv_heads, 0, tp_size)
        staging = GroupStaging(region.buffer, num_kv_heads, heads, channel.stages, channel.try_sync)
        _attach(kv_cache, layout, staging)
        return staging


def follow_staging(
    config: Config, kv_cache: KVCache, num_kv_heads: int, rank: int, tp_size: int
) -> FollowerStaging | None:
    """A follower's side: the leader's region mapped, this rank's heads of it mirrored; None
    where the group stages nothing."""
    layout = _layout(config, kv_cache, num_kv_heads)
    if layout is None:
        return None
    path = _broadcast_path(None)
    try:
        region = SharedRegion(layout.num_layers * layout.region_bytes, path)
    except (OSError, ValueError):
        _all_mapped(False)
        raise
    _all_mapped(True)
    staging = GroupStaging(region.buffer, num_kv_heads, writer_heads(num_kv_heads, rank, tp_size))
    _attach(kv_cache, layout, staging)
    return FollowerStaging(kv_cache, StagingPool(layout, staging.buffer), staging.heads)


def _attach(kv_cache: KVCache, layout: StagingLayout, staging: GroupStaging) -> None:
    """This rank's heads of the region: its pool's home (a ``vllm_blocks`` pool: no mirror,
    the region is the group's pool) or its KV mirror."""
    if staging.heads is None:  # a replicated head's second holder: its first holder's there
        return
    if kv_cache.layout.kind == VLLM_BLOCKS:
        kv_cache.share_storage(staging.buffer, staging.num_kv_heads, staging.heads)
        return
    pool = StagingPool(layout, staging.buffer)
    layers = [pool.layer_view(i) for i in range(layout.num_layers)]
    dtype = TORCH_DTYPES[kv_cache.layout.dtype]
    kv_cache.attach_mirror(KVMirror(layers, dtype, staging.heads))


def _broadcast_path(path: str | None) -> str:
    """Rank 0's ``path`` on every rank."""
    data = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
    if path is not None:
        raw = path.encode()
        assert len(raw) < _PATH_BYTES, path
        data[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return bytes(data.numpy()).rstrip(b"\0").decode()


def _all_mapped(is_mapped: bool) -> bool:
    flag = torch.tensor([1 if is_mapped else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class FollowerStaging:
    """A follower's share of the leader's repacks (``tp.follower.Stager``): each stage copied
    from this rank's pool into its heads of the shared blocks, on the step's thread, before
    it answers the step. A rank whose heads another rank writes copies nothing."""

    def __init__(self, kv_cache: KVCache, staging: StagingPool, heads: range | None) -> None:
        self._pool = PoolViews(kv_cache.regions(0, 0))
        self._staging, self.heads = staging, heads

    def apply(self, stages: Sequence[Stage]) -> None:
        if self.heads is None:
            return
        for s in stages:
            tokens = range(s.start, s.stop)
            repack(
                self._pool, self._staging, s.page_ids, s.first_page, s.block_ids, tokens, self.heads
            )


class Unmirrored:
    """A follower's runner that writes no KV mirror: its heads are another rank's replicas,
    which that rank writes into the shared region."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    def run(self, plan: BatchPlan) -> BatchOutput:
        chunks = tuple(dataclasses.replace(c, mirror_slots=()) for c in plan.chunks)
        return self._runner.run(dataclasses.replace(plan, chunks=chunks))
