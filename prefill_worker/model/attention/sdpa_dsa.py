"""DeepSeek sparse attention (DSA) on torch, CPU and CUDA: the lightning indexer's top-k
choice per query, then MLA attention over the chosen keys only. Planned as ``SdpaBackend``
(each chunk's prefix rows ``[0, start)`` read from its pages by (page, offset)).

Per chunk of ``n`` queries at positions ``[start, end)`` over its ``end`` keys::

    s[i, h, j]  = relu(q_idx[i, h] . k_idx[j] * head_dim ** -0.5)     fp32 [n, Hi, end]
    score[i, j] = sum_h w[i, h] * s[i, h, j]  (w = weights_proj(x) * Hi ** -0.5)
    keep[i]     = the top-k of score[i] over the keys j <= start + i it sees   [n, end]
    out         = MLA attention (``MLASdpaBackend``) under the mask ``keep``

transformers' indexer and mask, row for row: a query that sees no more than ``topk`` keys
keeps them all (dense causal attention: not scored here, and a chunk whose queries all see
so few runs plain causal attention), so the choice matters only past ``topk`` tokens; the
choice of a query depends on its keys only, never on the chunking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefill_worker.model.attention.sdpa_mla import MLASdpaBackend
from prefill_worker.model.hf_config import MLASpec
from prefill_worker.model.quant.kv import from_pool

SCORE_BLOCK_BYTES = 256 << 20  # fp32 per-head scores of one block of queries
SCORE_BLOCK_ROWS = 128  # at most: a block scores the keys up to its last query


class DSASdpaBackend(MLASdpaBackend):
    """``MLASdpaBackend`` plus the indexer's choice (``select``) and attention under it."""

    name = "sdpa_dsa"

    def select(
        self,
        q_index: torch.Tensor,  # [T, Hi, Di], rope applied
        weights: torch.Tensor,  # [T, Hi] fp32, weights_proj(x) * Hi ** -0.5
        k_index: torch.Tensor,  # [T, Di], this batch's fresh index keys (written to the pool)
        index_pool: torch.Tensor,  # [P, page_size, Di], the layer's index keys
        topk: int,
    ) -> tuple[torch.Tensor | None, ...]:
        """Each planned chunk's mask ``[n, end]`` (True = attend): its planned causal one
        (None for a fresh chunk: plain causal) where no query sees more than ``topk`` keys,
        so nothing is scored; else the indexer's choice."""
        scale = q_index.shape[-1] ** -0.5
        masks: list[torch.Tensor | None] = []
        for p in self._planned:
            start = 0 if p.kv_rows is None else int(p.kv_rows[0].shape[0])
            if start + p.q_end - p.q_start <= topk:
                masks.append(p.mask)
                continue
            keys = k_index[p.q_start : p.q_end]
            if p.kv_rows is not None:
                keys = torch.cat([from_pool(index_pool[p.kv_rows], keys.dtype), keys])
            q = q_index[p.q_start : p.q_end].float() * scale  # a copy: the caller's q stays
            masks.append(_top_keys(q, weights[p.q_start : p.q_end], keys.float(), topk))
        return tuple(masks)

    def attend_sparse(
        self,
        q: torch.Tensor,  # [T, H, nope + rope], RoPE applied
        rows: torch.Tensor,  # [T, r + rope], this batch's fresh pool rows
        pool: torch.Tensor,  # [P, page_size, 1, r + rope], rows written
        kv_b: torch.Tensor,  # [H (nope + v), r]
        spec: MLASpec,
        keep: tuple[torch.Tensor | None, ...],  # per planned chunk (``select``)
        out: torch.Tensor,  # [T, H, v], written
    ) -> None:
        for p, mask in zip(self._planned, keep, strict=True):
            self._attend_chunk(p, q, rows, pool, kv_b, spec, mask, out)


def _top_keys(
    q: torch.Tensor,  # [n, Hi, Di] fp32, scaled by Di ** -0.5
    w: torch.Tensor,  # [n, Hi] fp32
    keys: torch.Tensor,  # [end, Di] fp32
    topk: int,
) -> torch.Tensor:
    """``keep [n, end]``: each query's top-``topk`` keys by index score among those it sees
    (all of them while it sees no more than ``topk``). Scored in blocks of queries, each
    against the keys up to its last query only (the later ones are in every query's future)."""
    n, heads, end = q.shape[0], q.shape[1], keys.shape[0]
    first = end - n  # position of the chunk's first query
    positions = torch.arange(first, end, device=q.device)[:, None]  # [n, 1]
    keep = torch.arange(end, device=q.device)[None, :] <= positions  # causal [n, end]
    dense = max(0, topk - first)  # rows that see at most topk keys keep them all
    block = max(1, min(SCORE_BLOCK_ROWS, SCORE_BLOCK_BYTES // (4 * heads * end)))
    for lo in range(dense, n, block):
        hi, seen = min(n, lo + block), first + min(n, lo + block)  # keys [0, seen)
        scores = torch.matmul(q[lo:hi], keys[:seen].T)  # [b, Hi, seen]
        index = torch.matmul(w[lo:hi, None, :], F.relu_(scores))[:, 0]  # [b, seen]
        index.masked_fill_(~keep[lo:hi, :seen], float("-inf"))
        chosen = index.topk(topk, dim=-1).indices  # every one seen: > topk keys visible
        keep[lo:hi] = False
        keep[lo:hi].scatter_(1, chosen, True)
    return keep
