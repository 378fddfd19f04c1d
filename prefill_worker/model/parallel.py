"""Tensor parallelism's seam in the model: the group record, the head-slice rules, the one
collective layer kind.

A tensor-parallel (TP) group of ``size`` ranks runs the same forward on the same tokens; each
rank holds a slice of every large matrix (``model.sharding`` says which slice of which tensor):

    embed, norms, LM head    replicated: every rank holds all of it, runs it, gets the same
                             result (no collective)
    q/k/v, gate/up           column-parallel: rank r holds its heads' (its intermediate
                             range's) output rows; no collective, the output stays sharded
    o, down                  row-parallel: rank r holds the matching input columns; its
                             partial product is summed over ranks by ONE all-reduce, then the
                             bias (if any) is added once

so a layer costs two all-reduces of ``[T, hidden]``. The residual stream, hence the logits, is
identical on every rank. Embedding and LM head are replicated, not vocab-parallel: a prefill
computes logits for one row per finished prompt, so the head's FLOPs are negligible and a
sharded head would add a collective per batch for nothing but memory; the price is
``2 * vocab * hidden`` elements per rank (2.1 GB at Llama-3-8B's shape in bf16), which
``docs/parallelism.md`` weighs.

KV heads (``kv_head_range``, THE rule both the model and the transfer side slice by; it lives
torch-free in ``kv.heads`` so the transfer side can import it):

    num_kv_heads >= size  (size must divide it):  rank r holds heads
                          [r * KV / size, (r + 1) * KV / size)
    num_kv_heads <  size  (it must divide size):  rank r holds the one head r * KV // size,
                          each head replicated on size / KV consecutive ranks

Query heads split evenly (``size`` must divide ``num_heads``): rank r holds
[r * H / size, (r + 1) * H / size), which are exactly the query heads of its KV heads.

TP 1 (``SINGLE``) is the unsharded model: every range is the whole, no collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefill_worker.kv import heads
from prefill_worker.model.quant.linear import Weight, linear


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place in its tensor-parallel group. ``group`` is the
    ``torch.distributed`` process group of the ranks (None: the default group, and for
    size 1 no group at all)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} of size {self.size} is not a rank")

    @property
    def is_single(self) -> bool:
        return self.size == 1


SINGLE = TPGroup()


def even_range(total: int, tp: TPGroup) -> range:
    """Rank ``tp.rank``'s equal share of ``total`` units; ``tp.size`` must divide it."""
    if total % tp.size:
        raise ValueError(f"{total} does not split over {tp.size} tensor-parallel ranks")
    share = total // tp.size
    return range(tp.rank * share, (tp.rank + 1) * share)


def q_head_range(num_heads: int, tp: TPGroup) -> range:
    """The query (attention) heads rank ``tp.rank`` computes."""
    if num_heads % tp.size:
        raise ValueError(f"{num_heads} attention heads do not split over {tp.size} ranks")
    return even_range(num_heads, tp)


def kv_head_range(num_kv_heads: int, tp: TPGroup) -> range:
    """The KV heads rank ``tp.rank`` computes and keeps in its pool (module docstring): the
    one rule, ``kv.heads.kv_head_range``, which the transfer side reads too (torch-free)."""
    return heads.kv_head_range(num_kv_heads, tp.rank, tp.size)


def check_shardable(num_heads: int, num_kv_heads: int, intermediate: int, tp: TPGroup) -> None:
    """Raise ``ValueError`` (a configuration problem) if the model cannot run at ``tp``."""
    q_head_range(num_heads, tp)
    kv_head_range(num_kv_heads, tp)
    even_range(intermediate, tp)


def row_parallel(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, tp: TPGroup
) -> torch.Tensor:
    """``x [T, in/size] @ weight[out, in/size].T``, summed over the ranks, plus ``bias``.
    At TP 1 exactly ``linear(x, weight, bias)`` (``quant.linear``: dense or FP8 kept)."""
    if tp.is_single:
        return linear(x, weight, bias)
    out = linear(x, weight)  # [T, out], this rank's partial sum
    torch.distributed.all_reduce(out, group=tp.group)
    return out if bias is None else out.add_(bias)


def all_reduce_(partial: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``partial`` summed over the ranks, in place (a MoE block's one collective: the routed
    and shared experts' partial sums, added first). At TP 1 ``partial`` itself."""
    if not tp.is_single:
        torch.distributed.all_reduce(partial, group=tp.group)
    return partial


def broadcast_from_leader_(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``tensor`` as the group's rank 0 holds it, on every rank, in place (what only the
    leader knows, such as its sampled tokens). At TP 1 ``tensor`` itself."""
    if not tp.is_single:
        torch.distributed.broadcast(tensor, group=tp.group, group_src=0)
    return tensor


def gather_kv_heads(per_rank: Sequence[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """The full ``[..., KV, D]`` from each rank's ``[..., local KV, D]`` (rank order), by
    ``kv_head_range``; replicas of a head must agree exactly. For tests and tools."""
    tp_size = len(per_rank)
    heads: list[torch.Tensor | None] = [None] * num_kv_heads
    for rank, local in enumerate(per_rank):
        owned = kv_head_range(num_kv_heads, TPGroup(rank, tp_size))
        if local.shape[-2] != len(owned):
            raise ValueError(f"rank {rank} holds {local.shape[-2]} KV heads, not {len(owned)}")
        for i, head in enumerate(owned):
            known = heads[head]
            if known is not None and not torch.equal(known, local[..., i, :]):
                raise ValueError(f"KV head {head}: rank {rank}'s replica differs")
            heads[head] = local[..., i, :]
    return torch.stack([h for h in heads if h is not None], dim=-2)
