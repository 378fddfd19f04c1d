"""How a refusal names a multi-head latent attention (MLA) pool (``kv.layout`` kind ``mla``)
when a decode's pool does not match it.

An MLA pool holds one latent row per token per layer (``kv_lora_rank + qk_rope_head_dim``
values, the layout's ``head_dim``), L regions of one latent page each, no K/V split and no
heads: nothing is sliced. Which tensor-parallel rank writes it is not decided here: it is the
replicated one-head case of ``transfer.headplan`` (every rank holds the same latent; one of
them writes each decode rank). Torch-, ZMQ- and NIXL-free.
"""

from __future__ import annotations

from prefill_worker.kv.layout import MLA, KVLayout


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
