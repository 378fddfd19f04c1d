"""The tensors of a Qwen3-Next / Qwen3.5 checkpoint: their names and shapes, and how they fuse
into ``qwen3_next.HybridModelWeights`` (``loader`` calls both for a spec with ``linear``).

What changes on the way in:
- every ``(1 + weight)`` RMSNorm (the decoder's norms, the final norm, q_norm and k_norm)
  gets its 1 added once, so the model runs plain RMSNorms; the gated norm inside a linear
  layer scales by its weight as stored;
- a linear layer's input projections become one matrix ``[q k v | z | b | a]``: Qwen3.5's
  four are concatenated; Qwen3-Next's two (``in_proj_qkvz``, ``in_proj_ba``) store them
  interleaved per key head (``[q k v z]`` of head group 0, then of group 1, ...) and are
  taken apart first;
- a full layer's q (per head ``[q | gate]``), k and v projections become one matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefill_worker.model.gdn import GDNWeights
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.model.llama import DenseMLP
from prefill_worker.model.moe.block import MoEWeights, fuse_moe, moe_shapes
from prefill_worker.model.qwen3_next import (
    GatedAttentionWeights,
    HybridLayerWeights,
    HybridModelWeights,
)

Get = Callable[[str], torch.Tensor]


def hybrid_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name a hybrid checkpoint must hold, with its shape."""
    assert spec.linear is not None
    lin, hidden = spec.linear, spec.hidden_size
    shapes = spec.outer_shapes()
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if i in lin.linear_layers:
            shapes |= _linear_shapes(lin, hidden, p + "linear_attn.")
        else:
            shapes |= _attention_shapes(spec, p + "self_attn.")
        if spec.moe is not None and spec.is_sparse(i):
            shapes |= moe_shapes(spec.moe, hidden, p + "mlp.")
        else:
            inter = spec.intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def _linear_shapes(lin: LinearAttentionSpec, hidden: int, p: str) -> dict[str, tuple[int, ...]]:
    hv = lin.num_v_heads
    shapes: dict[str, tuple[int, ...]] = {
        p + "A_log": (hv,),
        p + "dt_bias": (hv,),
        p + "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel),
        p + "norm.weight": (lin.head_v_dim,),
        p + "out_proj.weight": (hidden, lin.value_dim),
    }
    if lin.qkvz_grouped:
        shapes[p + "in_proj_qkvz.weight"] = (lin.conv_dim + lin.value_dim, hidden)
        shapes[p + "in_proj_ba.weight"] = (2 * hv, hidden)
    else:
        shapes[p + "in_proj_qkv.weight"] = (lin.conv_dim, hidden)
        shapes[p + "in_proj_z.weight"] = (lin.value_dim, hidden)
        shapes[p + "in_proj_b.weight"] = (hv, hidden)
        shapes[p + "in_proj_a.weight"] = (hv, hidden)
    return shapes


def _attention_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    hidden, dim = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * dim, spec.num_kv_heads * dim
    return {
        p + "q_proj.weight": (2 * q_out, hidden),
        p + "k_proj.weight": (kv_out, hidden),
        p + "v_proj.weight": (kv_out, hidden),
        p + "o_proj.weight": (hidden, q_out),
        p + "q_norm.weight": (dim,),
        p + "k_norm.weight": (dim,),
    }


def fuse_hybrid(spec: ModelSpec, get: Get) -> HybridModelWeights:
    """The checkpoint's tensors, by HF name (``get``), fused into the model's weights."""
    embed = get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    layers = tuple(_layer(spec, get, i) for i in range(spec.num_layers))
    return HybridModelWeights(embed, layers, _norm(get, "model.norm.weight"), lm_head)


def _norm(get: Get, name: str) -> torch.Tensor:
    """A ``(1 + weight)`` RMSNorm's scale, the 1 added."""
    return get(name) + 1.0


def _layer(spec: ModelSpec, get: Get, index: int) -> HybridLayerWeights:
    assert spec.linear is not None
    p = f"model.layers.{index}."
    mixer: GatedAttentionWeights | GDNWeights
    if index in spec.linear.linear_layers:
        mixer = _gdn(spec.linear, get, p + "linear_attn.")
    else:
        a = p + "self_attn."
        mixer = GatedAttentionWeights(
            qkv=torch.cat([get(f"{a}{n}_proj.weight") for n in "qkv"]),
            o=get(a + "o_proj.weight"),
            q_norm=_norm(get, a + "q_norm.weight"),
            k_norm=_norm(get, a + "k_norm.weight"),
        )
    mlp: DenseMLP | MoEWeights
    if spec.moe is not None and spec.is_sparse(index):
        mlp = fuse_moe(spec.moe, get, p + "mlp.")
    else:
        m = p + "mlp."
        gate_up = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
        mlp = DenseMLP(gate_up, None, get(m + "down_proj.weight"), None)
    return HybridLayerWeights(
        input_norm=_norm(get, p + "input_layernorm.weight"),
        mixer=mixer,
        post_norm=_norm(get, p + "post_attention_layernorm.weight"),
        mlp=mlp,
    )


def _gdn(lin: LinearAttentionSpec, get: Get, p: str) -> GDNWeights:
    if lin.qkvz_grouped:
        in_proj = torch.cat(
            ungroup_qkvz(lin, get(p + "in_proj_qkvz.weight"), get(p + "in_proj_ba.weight"))
        )
    else:
        in_proj = torch.cat([get(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
    return GDNWeights(
        in_proj=in_proj,
        conv=get(p + "conv1d.weight")[:, 0, :],
        a_log=get(p + "A_log"),
        dt_bias=get(p + "dt_bias"),
        norm=get(p + "norm.weight"),
        out=get(p + "out_proj.weight"),
    )


def ungroup_qkvz(
    lin: LinearAttentionSpec, qkvz: torch.Tensor, ba: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's per-key-head interleaved rows as ``(q, k, v, z, b, a)`` row blocks, each
    holding every head in order (value head ``g * r + j`` is group g's j-th, r = Hv / Hk).
    Under tensor parallelism ``qkvz`` holds the rank's key-head groups only (``sharding``):
    the count of groups is read from its rows."""
    r = lin.num_v_heads // lin.num_k_heads
    dk, rv = lin.head_k_dim, r * lin.head_v_dim
    hk = qkvz.shape[0] // (2 * dk + 2 * rv)
    grouped = qkvz.view(hk, 2 * dk + 2 * rv, -1)  # [Hk, q k v z rows, hidden]
    q, k, v, z = grouped.split([dk, dk, rv, rv], dim=1)
    b, a = ba.view(hk, 2 * r, -1).split([r, r], dim=1)
    return tuple(t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v, z, b, a))
