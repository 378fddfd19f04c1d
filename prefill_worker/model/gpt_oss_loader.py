"""The tensors of a gpt-oss checkpoint: their names and shapes, and how they fuse into
``gpt_oss.GptOssModelWeights`` (``loader`` calls both for a spec with ``sliding``).

Experts come in one of two forms. Unquantized (what ``transformers`` saves):
``experts.gate_up_proj [E, hidden, 2I]`` and ``experts.down_proj [E, I, hidden]``, stored
input-major. As shipped (``quantization_config.quant_method == "mxfp4"``):
``experts.{gate_up,down}_proj_blocks [E, rows, cols/32, 16]`` uint8, two FP4 (e2m1) values a
byte, low nibble first, and ``_scales [E, rows, cols/32]`` uint8, one power-of-two exponent
(biased by 127) per 32 values; rows are the output features. Both are turned into
``[E, out, in]`` matrices at load (MXFP4 dequantized once: ``fp4 * 2 ** (scale - 127)``),
and the interleaved gate/up rows (gate even, up odd) into gate rows then up rows; or, where
``keep_mxfp4`` (``moe.mxfp4``'s choice: flashinfer's W4A16 MoE on an SM90 GPU), kept as
shipped in ``GptOssMxfp4Experts``, packed into the rows and padding that kernel wants.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefill_worker.model.gpt_oss import (
    GptOssExperts,
    GptOssLayerWeights,
    GptOssModelWeights,
    GptOssMxfp4Experts,
)
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.moe.mxfp4 import (
    FP4_VALUES,
    MXFP4_BLOCK,
    dequantize_mxfp4,
    pack_down,
    pack_gate_up,
)

__all__ = ["FP4_VALUES", "fuse_gpt_oss", "gpt_oss_shapes"]

Get = Callable[[str], torch.Tensor]


def gpt_oss_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name a gpt-oss checkpoint must hold, with its shape."""
    assert spec.sliding is not None
    hidden, inter, dim = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out, experts = spec.num_heads * dim, spec.num_kv_heads * dim, spec.sliding.num_experts
    shapes = spec.outer_shapes()
    for i in range(spec.num_layers):
        p, a, e = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            a + "q_proj.weight": (q_out, hidden),
            a + "k_proj.weight": (kv_out, hidden),
            a + "v_proj.weight": (kv_out, hidden),
            a + "o_proj.weight": (hidden, q_out),
            a + "q_proj.bias": (q_out,),
            a + "k_proj.bias": (kv_out,),
            a + "v_proj.bias": (kv_out,),
            a + "o_proj.bias": (hidden,),
            a + "sinks": (spec.num_heads,),
            e + "router.weight": (experts, hidden),
            e + "router.bias": (experts,),
            e + "experts.gate_up_proj_bias": (experts, 2 * inter),
            e + "experts.down_proj_bias": (experts, hidden),
        }
        if spec.sliding.mxfp4:
            shapes |= _mxfp4_shapes(e + "experts.gate_up_proj", experts, 2 * inter, hidden)
            shapes |= _mxfp4_shapes(e + "experts.down_proj", experts, hidden, inter)
        else:
            shapes[e + "experts.gate_up_proj"] = (experts, hidden, 2 * inter)
            shapes[e + "experts.down_proj"] = (experts, inter, hidden)
    return shapes


def _mxfp4_shapes(name: str, experts: int, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
    if cols % MXFP4_BLOCK:
        raise ValueError(f"{name}: {cols} input features do not split into MXFP4 blocks of 32")
    groups = cols // MXFP4_BLOCK
    return {
        name + "_blocks": (experts, rows, groups, 16),
        name + "_scales": (experts, rows, groups),
    }


def fuse_gpt_oss(spec: ModelSpec, get: Get, keep_mxfp4: bool = False) -> GptOssModelWeights:
    embed = get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
    layers = tuple(_layer(spec, get, i, keep_mxfp4) for i in range(spec.num_layers))
    return GptOssModelWeights(embed, layers, get("model.norm.weight"), lm_head)


def _layer(spec: ModelSpec, get: Get, index: int, keep_mxfp4: bool) -> GptOssLayerWeights:
    p = f"model.layers.{index}."
    a = p + "self_attn."
    return GptOssLayerWeights(
        input_norm=get(p + "input_layernorm.weight"),
        qkv=torch.cat([get(f"{a}{n}_proj.weight") for n in "qkv"]),
        qkv_bias=torch.cat([get(f"{a}{n}_proj.bias") for n in "qkv"]),
        o=get(a + "o_proj.weight"),
        o_bias=get(a + "o_proj.bias"),
        sinks=get(a + "sinks"),
        post_norm=get(p + "post_attention_layernorm.weight"),
        experts=_kept(get, p + "mlp.") if keep_mxfp4 else _experts(spec, get, p + "mlp."),
    )


def _experts(spec: ModelSpec, get: Get, m: str) -> GptOssExperts:
    assert spec.sliding is not None
    e = m + "experts."
    if spec.sliding.mxfp4:
        gate_up = _dequantized(get, e + "gate_up_proj")  # [E, 2I, hidden], interleaved
        down = _dequantized(get, e + "down_proj")  # [E, hidden, I]
    else:
        gate_up = get(e + "gate_up_proj").transpose(1, 2)
        down = get(e + "down_proj").transpose(1, 2).contiguous()
    return GptOssExperts(
        router=get(m + "router.weight"),
        router_bias=get(m + "router.bias"),
        gate_up=_gate_rows_first(gate_up, dim=1).contiguous(),
        gate_up_bias=_gate_rows_first(get(e + "gate_up_proj_bias"), dim=1).contiguous(),
        down=down,
        down_bias=get(e + "down_proj_bias"),
    )


def _kept(get: Get, m: str) -> GptOssMxfp4Experts:
    """The MXFP4 stacks as shipped, packed for the kernel (``get``'s cast of the bytes undone,
    exactly, as ``_dequantized`` does)."""
    e = m + "experts."

    def stack(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raw = (get(e + name + "_blocks"), get(e + name + "_scales"))
        return raw[0].to(torch.uint8), raw[1].to(torch.uint8), get(e + name + "_bias")

    stacks = (pack_gate_up(*stack("gate_up_proj")), pack_down(*stack("down_proj")))
    return GptOssMxfp4Experts(get(m + "router.weight"), get(m + "router.bias"), stacks)


def _gate_rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up (gate at even indices of ``dim``) as gate half, then up half."""
    gate, up = t.unflatten(dim, (-1, 2)).unbind(dim + 1)
    return torch.cat([gate, up], dim=dim)


def _dequantized(get: Get, name: str) -> torch.Tensor:
    """``name``'s MXFP4 blocks and scales as ``[E, rows, cols]`` in the dtype ``get`` gives,
    dequantized one expert at a time. ``get`` casts the stored uint8 to that dtype, exactly
    (every byte is an integer below 257); the bytes are taken back from it."""
    like = get(name + "_scales")
    blocks, scales = get(name + "_blocks").to(torch.uint8), like.to(torch.int32) - 127
    out = like.new_empty(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)
    for expert in range(out.shape[0]):  # one expert's fp32 at a time (120b: 200 MB, not 8 GB)
        out[expert] = dequantize_mxfp4(blocks[expert], scales[expert])
    return out
