"""The KV-head rule of tensor parallelism, torch-free: which KV heads rank ``rank`` of a
group of ``tp_size`` ranks computes and keeps in its pool. The model (``model.parallel``),
the per-rank pool and the transfer side (``transfer.headplan``) all slice by this one
function; nothing re-derives it::

    num_kv_heads >= tp_size  (tp_size must divide it):  rank r holds heads
                             [r * KV / tp_size, (r + 1) * KV / tp_size)
    num_kv_heads <  tp_size  (it must divide tp_size):  rank r holds the one head
                             r * KV // tp_size, each head on tp_size / KV consecutive ranks

It is SGLang's and vLLM's rule, so a decode of either at the same TP holds the same heads.
"""

from __future__ import annotations


def kv_head_range(num_kv_heads: int, rank: int, tp_size: int) -> range:
    """The KV heads rank ``rank`` of ``tp_size`` holds; ``ValueError`` when they do not split
    (or replicate) over ``tp_size`` ranks, or ``rank`` is not one of them."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"TP rank {rank} of size {tp_size} is not a rank")
    if num_kv_heads < 1:
        raise ValueError(f"{num_kv_heads} KV heads: at least one is needed")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        share = num_kv_heads // tp_size
        return range(rank * share, (rank + 1) * share)
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {tp_size} ranks")
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)
