"""The sliding-window part of a config whose layers alternate local (sliding-window) and
global attention: gpt-oss (``GptOssForCausalLM``). Read by ``hf_config.spec_from_dict`` for
those families only; torch-free.

A sliding layer's query at position ``p`` sees the keys of positions ``(p - window, p]``
(``window`` keys, itself included), a full layer's every earlier position. gpt-oss adds a
learned per-head attention sink (one more logit in each softmax, whose value is dropped), a
MoE MLP whose router has a bias (top-k of the logits, softmax over the k) and whose experts
run a clamped SwiGLU with biases, and ships its experts' weights as MXFP4
(``quantization_config.quant_method == "mxfp4"``; dequantized at load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLIDING_FAMILIES = ("gpt_oss",)
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
MXFP4 = "mxfp4"


@dataclass(frozen=True, slots=True)
class SlidingSpec:
    """Which layers slide and how far, and gpt-oss's sinks and experts."""

    layer_kinds: tuple[str, ...]  # per layer: SLIDING_ATTENTION | FULL_ATTENTION
    window: int  # keys a sliding layer's query sees, itself included
    has_sinks: bool
    num_experts: int
    top_k: int
    swiglu_alpha: float
    swiglu_limit: float
    mxfp4: bool  # the experts' weights are stored as MXFP4 blocks and scales

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == SLIDING_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == FULL_ATTENTION)

    def window_of(self, layer: int) -> int | None:
        """The layer's window; None for a full layer."""
        return self.window if self.layer_kinds[layer] == SLIDING_ATTENTION else None


def sliding_spec(raw: Mapping[str, Any]) -> SlidingSpec:
    """The sliding part of a gpt-oss config; ``ValueError`` names a bad field."""
    num_layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)
    ]
    kinds = tuple(str(k) for k in kinds)
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING_ATTENTION, FULL_ATTENTION}:
        raise ValueError(f"layer_types {list(kinds)} do not name {num_layers} attention layers")
    window = int(raw.get("sliding_window") or 0)
    if window < 1 and SLIDING_ATTENTION in kinds:
        raise ValueError(f"sliding_window {raw.get('sliding_window')!r} is not a positive size")
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


def quant_method(raw: Mapping[str, Any]) -> str | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    return str(quant.get("quant_method") if isinstance(quant, dict) else quant)
