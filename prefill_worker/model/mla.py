"""Multi-head latent attention (DeepSeek-V2/V3): its weights, how they load, its forward.

Each token's KV is compressed to one latent row that every head shares; the pool (an ``mla``
pool, ``kv_cache``) holds exactly that row per token per layer, SGLang's layout::

    q            = q_b(norm(q_a(h)))  (or q_proj(h))      [T, H, nope + rope]
    latent, kr   = kv_a(h)                                [T, r], [T, rope]
    latent       = kv_a_norm(latent);  kr, q[..., nope:] = RoPE
    pool row     = [latent | kr]                          [T, r + rope]
    per chunk:   k_nope, v = kv_b(pool rows [0, end))     [m, H, nope], [m, H, v]
                 k = [k_nope | kr]  (kr broadcast over the heads)
                 out = softmax(q k^T * softmax_scale) v   [n, H, v]

Prefill decompresses the latents of each chunk through ``kv_b`` and runs ordinary attention
("MHA form"), rather than absorbing ``kv_b`` into q and the output (the decode form): with n
queries over m keys, decompression costs ``m r H (nope + v)`` once, then attention works at
head width ``nope + rope`` (192 at DeepSeek-V3's shape); absorbed, every score and every
output works at width ``r + rope`` (576) per head. Prefill has n about m, so the absorbed
form does ~3x the attention FLOPs; it only wins for a few queries over many keys (decode).
docs/models.md has the measurement (``bench/mla_forms.py``). The attention itself is a
backend's (``attention.MLA_BACKENDS``): torch SDPA over decompressed latents (``sdpa_mla``),
or on CUDA flashinfer's kernels (``flashinfer_mla``: decompressed for a batch of fresh
prompts, absorbed over the pool's pages when a chunk reads earlier positions).

Rotary embedding covers the ``rope`` dimensions only. With ``rope_interleave`` (DeepSeek's
default) the pairs are adjacent elements and each rotated pair is written back in place, as
SGLang does (``is_neox_style=False``); transformers computes the same values but writes the
rotated even elements first, then the odd ones, so its cached key part is a fixed
permutation of ours (``tests`` compare through it). Under tensor parallelism a rank holds
its query heads' rows of ``q_b`` and ``kv_b`` and their columns of ``o``; ``q_a``, ``kv_a``
and their norms are replicated, so the latent, hence the pool, is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefill_worker.model.attention.base import MLAAttentionBackend
from prefill_worker.model.hf_config import MLASpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm
from prefill_worker.model.quant.linear import Weight, linear


@dataclass(frozen=True, slots=True, eq=False)
class MLAWeights:
    """One layer's MLA weights; under TP, q_b/kv_b/o hold this rank's heads (H: its count)."""

    q_a: Weight | None  # [q_lora_rank, hidden]; None: no low-rank q
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Weight  # [H (nope + rope), q_lora_rank], or q_proj [H (nope + rope), hidden]
    kv_a: Weight  # [r + rope, hidden]
    kv_a_norm: torch.Tensor  # [r]
    kv_b: torch.Tensor  # [H (nope + v), r]; dense (the attention backends split it per head)
    o: Weight  # [hidden, H v]


def mla_shapes(spec: MLASpec, hidden: int, heads: int, attn: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a layer's MLA (under ``attn``, e.g. ``model.layers.0.self_attn.``) holds."""
    rank, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        attn + "kv_a_proj_with_mqa.weight": (rank + rope, hidden),
        attn + "kv_a_layernorm.weight": (rank,),
        attn + "kv_b_proj.weight": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), rank),
        attn + "o_proj.weight": (hidden, heads * spec.v_head_dim),
    }
    q_out = heads * spec.qk_head_dim
    if spec.q_lora_rank is None:
        return shapes | {attn + "q_proj.weight": (q_out, hidden)}
    return shapes | {
        attn + "q_a_proj.weight": (spec.q_lora_rank, hidden),
        attn + "q_a_layernorm.weight": (spec.q_lora_rank,),
        attn + "q_b_proj.weight": (q_out, spec.q_lora_rank),
    }


def fuse_mla(
    spec: MLASpec,
    get: Callable[[str], torch.Tensor],
    attn: str,
    linear_weight: Callable[[str], Weight] | None = None,
) -> MLAWeights:
    """A layer's MLA tensors under ``attn``, as ``get(name)`` reads them (this rank's slice;
    the projections that run through ``quant.linear`` as ``linear_weight`` does, if given)."""
    low_rank = spec.q_lora_rank is not None
    lin = linear_weight or get
    return MLAWeights(
        q_a=lin(attn + "q_a_proj.weight") if low_rank else None,
        q_a_norm=get(attn + "q_a_layernorm.weight") if low_rank else None,
        q_b=lin(attn + ("q_b_proj.weight" if low_rank else "q_proj.weight")),
        kv_a=lin(attn + "kv_a_proj_with_mqa.weight"),
        kv_a_norm=get(attn + "kv_a_layernorm.weight"),
        kv_b=get(attn + "kv_b_proj.weight"),
        o=lin(attn + "o_proj.weight"),
    )


def mla_attention(
    h: torch.Tensor,  # [T, hidden], the input-normed residual
    w: MLAWeights,
    spec: MLASpec,
    eps: float,
    rope: tuple[Rotary, torch.Tensor, torch.Tensor],  # the rotary, cos and sin [T, 1, rope/2]
    cache: tuple[KVCache, int, torch.Tensor],  # the pool, this layer, slots [T]
    backend: MLAAttentionBackend,
) -> torch.Tensor:
    """Write the tokens' latent rows into the pool; return the heads' outputs ``[T, H, v]``."""
    kv_cache, layer, slots = cache
    q, rows, _ = mla_project(h, w, spec, eps, rope)
    kv_cache.write_latent(layer, slots, rows[:, : spec.kv_lora_rank], rows[:, spec.kv_lora_rank :])
    out = q.new_empty(q.shape[0], q.shape[1], spec.v_head_dim)
    backend.attend_latent(q, rows, kv_cache.k[layer], w.kv_b, spec, out)
    return out


def mla_project(
    h: torch.Tensor,  # [T, hidden], the input-normed residual
    w: MLAWeights,
    spec: MLASpec,
    eps: float,
    rope: tuple[Rotary, torch.Tensor, torch.Tensor],  # the rotary, cos and sin [T, 1, rope/2]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The roped queries ``[T, H, nope + rope]``, the pool rows ``[T, r + rope]`` and the
    low-rank q before ``q_b`` (``[T, q_lora_rank]``, a DSA indexer's input; None without)."""
    rotary, cos, sin = rope
    num_tokens, rank, nope = h.shape[0], spec.kv_lora_rank, spec.qk_nope_head_dim
    q_resid = None
    if w.q_a is not None and w.q_a_norm is not None:
        q_resid = rms_norm(linear(h, w.q_a), w.q_a_norm, eps)
        q = linear(q_resid, w.q_b)
    else:
        q = linear(h, w.q_b)
    q = q.view(num_tokens, -1, spec.qk_head_dim)  # [T, H, nope + rope]
    compressed = linear(h, w.kv_a)  # [T, r + rope]
    rows = torch.empty_like(compressed)  # the pool rows: [latent | roped key]
    rows[:, :rank] = rms_norm(compressed[:, :rank], w.kv_a_norm, eps)
    apply = rotary.apply_interleaved_into if spec.rope_interleave else rotary.apply_into
    apply(compressed[:, None, rank:], cos, sin, rows[:, None, rank:])
    q_rope = torch.empty_like(q[..., nope:])
    apply(q[..., nope:], cos, sin, q_rope)
    q[..., nope:] = q_rope
    return q, rows, q_resid
