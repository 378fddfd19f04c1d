"""The sliding-window part of a config whose layers alternate local (sliding-window) and
global attention: gpt-oss (``GptOssForCausalLM``) and Gemma 3 (``Gemma3ForCausalLM``). Read
by ``hf_config.spec_from_dict`` for those families only; torch-free.

A sliding layer's query at position ``p`` sees the keys of positions ``(p - window, p]``
(``window`` keys, itself included), a full layer's every earlier position. gpt-oss adds a
learned per-head attention sink (one more logit in each softmax, whose value is dropped), a
MoE MLP whose router has a bias (top-k of the logits, softmax over the k) and whose experts
run a clamped SwiGLU with biases, and ships its experts' weights as MXFP4
(``quantization_config.quant_method == "mxfp4"``; dequantized at load). Gemma 3's local
layers turn RoPE at their own base (``local_rope_theta``, no scaling), its softmax scale is
``query_pre_attn_scalar ** -0.5``; the global layers' rope is ``ModelSpec.rope``
(``global_rope_fields`` gives ``hf_config`` the fields to read it from, in either of the two
forms configs use).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLIDING_FAMILIES = ("gpt_oss", "gemma3")
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
MXFP4 = "mxfp4"


@dataclass(frozen=True, slots=True)
class SlidingSpec:
    """Which layers slide and how far, and gpt-oss's sinks and experts."""

    layer_kinds: tuple[str, ...]  # per layer: SLIDING_ATTENTION | FULL_ATTENTION
    window: int  # keys a sliding layer's query sees, itself included
    has_sinks: bool
    num_experts: int = 0  # gpt-oss's experts (0: a dense MLP)
    top_k: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False  # the experts' weights are stored as MXFP4 blocks and scales
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base
    query_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == SLIDING_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == FULL_ATTENTION)

    def window_of(self, layer: int) -> int | None:
        """The layer's window; None for a full layer."""
        return self.window if self.layer_kinds[layer] == SLIDING_ATTENTION else None


def sliding_spec(raw: Mapping[str, Any], family: str) -> SlidingSpec:
    """The sliding part of a gpt-oss or Gemma 3 config; ``ValueError`` names a bad field."""
    if family == "gemma3":
        return _gemma3(raw)
    kinds, window = _kinds(raw, 2)
    num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not in [1, {num_experts}]")
    return SlidingSpec(
        layer_kinds=kinds,
        window=window,
        has_sinks=True,
        num_experts=num_experts,
        top_k=top_k,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        mxfp4=quant_method(raw) == MXFP4,
    )


def _kinds(raw: Mapping[str, Any], pattern: int) -> tuple[tuple[str, ...], int]:
    """The layer kinds (``layer_types``, else every ``pattern``-th layer full) and the window."""
    num_layers = int(raw["num_hidden_layers"])
    listed = raw.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
    ]
    kinds = tuple(str(k) for k in listed)
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING_ATTENTION, FULL_ATTENTION}:
        raise ValueError(f"layer_types {list(kinds)} do not name {num_layers} attention layers")
    window = int(raw.get("sliding_window") or 0)
    if window < 1 and SLIDING_ATTENTION in kinds:
        raise ValueError(f"sliding_window {raw.get('sliding_window')!r} is not a positive size")
    return kinds, window


def _gemma3(raw: Mapping[str, Any]) -> SlidingSpec:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(field) is not None:
            raise ValueError(f"{field} {raw[field]!r} is not supported (Gemma 3 has none)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a causal LM only)")
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    kinds, window = _kinds(raw, pattern)
    params = raw.get("rope_parameters") or {}
    local = params.get(SLIDING_ATTENTION) or {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"sliding layers' rope type {local.get('rope_type')!r} is not supported")
    theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0)
    return SlidingSpec(
        layer_kinds=kinds,
        window=window,
        has_sinks=False,
        local_rope_theta=theta,
        query_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
    )


def global_rope_fields(raw: Mapping[str, Any], family: str) -> Mapping[str, Any]:
    """``raw`` with its global layers' rope as ``rope_parameters`` (Gemma 3 nests it by
    layer kind; older Gemma 3 configs give ``rope_theta`` and ``rope_scaling`` flat)."""
    params = raw.get("rope_parameters") or {}
    if family != "gemma3" or FULL_ATTENTION not in params:
        return raw
    return {**raw, "rope_parameters": params[FULL_ATTENTION]}


def quant_method(raw: Mapping[str, Any]) -> str | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    return str(quant.get("quant_method") if isinstance(quant, dict) else quant)
