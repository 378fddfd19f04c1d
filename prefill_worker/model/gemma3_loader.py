"""The tensors of a Gemma 3 (text) checkpoint: names, shapes, and their fusion into
``gemma3.Gemma3ModelWeights`` (``loader`` calls both for the ``gemma3`` family). Every
RMSNorm (the four of each layer, q_norm, k_norm, the final one) scales by ``1 + weight``:
the 1 is added here, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefill_worker.model.gemma3 import Gemma3LayerWeights, Gemma3ModelWeights
from prefill_worker.model.hf_config import ModelSpec

Get = Callable[[str], torch.Tensor]
_NORMS = ("input", "post_attention", "pre_feedforward", "post_feedforward")


def gemma3_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    hidden, inter, dim = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * dim, spec.num_kv_heads * dim
    shapes = spec.outer_shapes()
    for i in range(spec.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes |= {f"{p}{n}_layernorm.weight": (hidden,) for n in _NORMS}
        shapes |= {
            a + "q_proj.weight": (q_out, hidden),
            a + "k_proj.weight": (kv_out, hidden),
            a + "v_proj.weight": (kv_out, hidden),
            a + "o_proj.weight": (hidden, q_out),
            a + "q_norm.weight": (dim,),
            a + "k_norm.weight": (dim,),
            m + "gate_proj.weight": (inter, hidden),
            m + "up_proj.weight": (inter, hidden),
            m + "down_proj.weight": (hidden, inter),
        }
    return shapes


def fuse_gemma3(spec: ModelSpec, get: Get) -> Gemma3ModelWeights:
    embed = get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    layers = tuple(_layer(get, i) for i in range(spec.num_layers))
    return Gemma3ModelWeights(embed, layers, _norm(get, "model.norm.weight"), lm_head)


def _norm(get: Get, name: str) -> torch.Tensor:
    return get(name) + 1.0


def _layer(get: Get, index: int) -> Gemma3LayerWeights:
    p, a, m = (
        f"model.layers.{index}.",
        f"model.layers.{index}.self_attn.",
        f"model.layers.{index}.mlp.",
    )
    return Gemma3LayerWeights(
        input_norm=_norm(get, p + "input_layernorm.weight"),
        qkv=torch.cat([get(f"{a}{n}_proj.weight") for n in "qkv"]),
        q_norm=_norm(get, a + "q_norm.weight"),
        k_norm=_norm(get, a + "k_norm.weight"),
        o=get(a + "o_proj.weight"),
        post_attn_norm=_norm(get, p + "post_attention_layernorm.weight"),
        pre_ffw_norm=_norm(get, p + "pre_feedforward_layernorm.weight"),
        gate_up=torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
        down=get(m + "down_proj.weight"),
        post_ffw_norm=_norm(get, p + "post_feedforward_layernorm.weight"),
    )
