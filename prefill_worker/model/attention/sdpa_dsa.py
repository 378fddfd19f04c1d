"""DeepSeek sparse attention (DSA) on torch, CPU and CUDA: the lightning indexer's top-k
choice per query, then MLA attention over the chosen keys only. Planned as ``SdpaBackend``
(each chunk's prefix rows ``[0, start)`` read from its pages by (page, offset)).

Per chunk of ``n`` queries at positions ``[start, end)`` over its ``end`` keys::

    s[i, h, j]  = relu(q_idx[i, h] . k_idx[j]) * head_dim ** -0.5     fp32 [n, Hi, end]
    score[i, j] = sum_h w[i, h] * s[i, h, j]  (w = weights_proj(x) * Hi ** -0.5)
                  -inf where j > start + i (causal)
    keep[i]     = top-min(topk, end) of score[i]  AND causal                      [n, end]
    out         = MLA attention (``MLASdpaBackend``) under the mask ``keep``

transformers' indexer and mask, row for row: a query that sees no more than ``topk`` keys
keeps them all (dense causal attention), so the choice matters only past ``topk`` tokens;
the choice of a query depends on its keys only, never on the chunking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefill_worker.model.attention.sdpa_mla import MLASdpaBackend
from prefill_worker.model.hf_config import MLASpec
from prefill_worker.model.quant.kv import from_pool

SCORE_BLOCK_BYTES = 256 << 20  # fp32 per-head scores of one block of queries


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
    ) -> tuple[torch.Tensor, ...]:
        """Each planned chunk's ``keep`` mask ``[n, end]`` (True = attend)."""
        scale = q_index.shape[-1] ** -0.5
        masks = []
        for p in self._planned:
            keys = k_index[p.q_start : p.q_end]
            if p.kv_rows is not None:
                keys = torch.cat([from_pool(index_pool[p.kv_rows], keys.dtype), keys])
            q, w = q_index[p.q_start : p.q_end], weights[p.q_start : p.q_end]
            masks.append(_top_keys(q, w, keys.float(), scale, topk))
        return tuple(masks)

    def attend_sparse(
        self,
        q: torch.Tensor,  # [T, H, nope + rope], RoPE applied
        rows: torch.Tensor,  # [T, r + rope], this batch's fresh pool rows
        pool: torch.Tensor,  # [P, page_size, 1, r + rope], rows written
        kv_b: torch.Tensor,  # [H (nope + v), r]
        spec: MLASpec,
        keep: tuple[torch.Tensor, ...],  # per planned chunk [n, end] bool (``select``)
        out: torch.Tensor,  # [T, H, v], written
    ) -> None:
        for p, mask in zip(self._planned, keep, strict=True):
            self._attend_chunk(p, q, rows, pool, kv_b, spec, mask, out)


def _top_keys(
    q: torch.Tensor,  # [n, Hi, Di]
    w: torch.Tensor,  # [n, Hi] fp32
    keys: torch.Tensor,  # [end, Di] fp32
    scale: float,
    topk: int,
) -> torch.Tensor:
    """``keep [n, end]``: each query's top-``topk`` keys by index score, causal."""
    n, heads = q.shape[0], q.shape[1]
    end = keys.shape[0]
    first = end - n  # position of the chunk's first query
    keep = torch.zeros(n, end, dtype=torch.bool, device=q.device)
    block = max(1, SCORE_BLOCK_BYTES // (4 * heads * end))
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        scores = torch.matmul(q[lo:hi].float(), keys.T).mul_(scale)  # [b, Hi, end]
        index = torch.matmul(w[lo:hi, None, :], F.relu_(scores))[:, 0]  # [b, end]
        positions = torch.arange(first + lo, first + hi, device=q.device)[:, None]
        causal = torch.arange(end, device=q.device)[None, :] <= positions  # [b, end]
        index.masked_fill_(~causal, float("-inf"))
        chosen = index.topk(min(topk, end), dim=-1).indices
        keep[lo:hi].scatter_(1, chosen, True)
        keep[lo:hi] &= causal
    return keep
