"""What a transfer does differently when the pool is a multi-head latent attention (MLA)
latent (``kv.layout`` kind ``mla``): how the pool's shape is named when a decode's does not
match, and which prefill rank writes it.

An MLA pool holds one latent row per token per layer (``kv_lora_rank + qk_rope_head_dim``
values, the layout's ``head_dim``), L regions of one latent page each, no K/V split and no
heads: nothing is sliced, and under tensor parallelism every rank holds the same latent, so
one rank writes it (``writes_kv``). Torch-, ZMQ- and NIXL-free.
"""

from __future__ import annotations

from prefill_worker.kv.layout import MLA, KVLayout

WRITING_RANK = 0  # the tensor-parallel rank that writes an MLA pool to decodes


def pool_shape(layout: KVLayout) -> str:
    """The pool's kind and row shape, as a refusal names it."""
    if layout.kind == MLA:
        return f"mla (one latent of {layout.head_dim} values per token and layer)"
    return f"{layout.kind} ({layout.num_kv_heads} KV heads x head_dim {layout.head_dim})"


def mla_mismatch(theirs: KVLayout, ours: KVLayout) -> str | None:
    """Why a decode pool cannot take this worker's pages when either is an MLA pool and the
    kind or the latent width differ (named for both); None otherwise (the other checks
    apply)."""
    if MLA not in (theirs.kind, ours.kind):
        return None
    if (theirs.kind, theirs.head_dim) == (ours.kind, ours.head_dim):
        return None
    return (
        f"KV layout mismatch: the decode pool is {pool_shape(theirs)}, this worker's is "
        f"{pool_shape(ours)}; size the decode pool from the worker's layout (describe, "
        "or kv_layout in /readyz)"
    )


def writes_kv(layout: KVLayout, tp_rank: int) -> bool:
    """Whether prefill rank ``tp_rank`` writes its pool's pages to decodes: every rank of a
    K/V pool (each holds its own KV heads), only ``WRITING_RANK`` of an MLA pool (the others
    hold the same latent; writing it again would only cost bandwidth).

    The seam for tensor parallelism, decided here only. Nothing asks yet: the worker has one
    rank (0), which writes either way. When ranks come, each rank's push context asks before
    it posts page writes; a rank that does not write still answers its decodes (its status,
    and SGLang's dummy requests, ``is_dummy``) and posts no page write."""
    return layout.kind != MLA or tp_rank == WRITING_RANK
