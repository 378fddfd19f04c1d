"""The linear-attention part of a hybrid config (Qwen3-Next, Qwen3.5): which layers are gated
DeltaNet layers, their head shapes, and what their full-attention layers do differently.

Read by ``hf_config.spec_from_dict`` for the hybrid families only; torch-free. A hybrid
model's layers are of two kinds here (``kv.state_layout`` names them): ``full_attention``
layers keep K/V in the paged pool, ``linear_attention`` layers keep one fixed-size state per
request (a causal-conv window and a recurrent matrix per value head) in the state pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefill_worker.kv.state_layout import FULL_ATTENTION, LINEAR_ATTENTION

HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@dataclass(frozen=True, slots=True)
class LinearAttentionSpec:
    """Gated DeltaNet (linear attention) and the hybrid's gated full attention.

    Linear layers: ``x -> [q k v | z | b a]`` projections; q/k/v go through a causal depthwise
    conv of ``conv_kernel`` taps, then the chunked gated delta rule with ``num_k_heads`` key
    heads shared by ``num_v_heads`` value heads. Full layers: the query projection also
    yields a per-head output gate (``sigmoid``), and RoPE turns only the first
    ``rotary_dim`` of each head. ``qkvz_grouped``: the checkpoint stores q/k/v/z (and b/a)
    interleaved per key head (Qwen3-Next), not one after the other (Qwen3.5)."""

    layer_kinds: tuple[str, ...]  # per layer: FULL_ATTENTION | LINEAR_ATTENTION
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    rotary_dim: int
    qkvz_grouped: bool

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def slot_bytes(self, conv_itemsize: int) -> int:
        """One request's state over every linear layer: the conv window (``kernel - 1``
        inputs of every channel, in the model's dtype) and the fp32 recurrent matrix."""
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_itemsize
        recurrent = self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
        return len(self.linear_layers) * (conv + recurrent)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The model's layers with K/V in the pool, in order (pool layer i is the i-th)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The model's layers with a state slot, in order (state layer i is the i-th)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == LINEAR_ATTENTION)


def linear_spec(raw: Mapping[str, Any], family: str, head_dim: int) -> LinearAttentionSpec:
    num_layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None:  # transformers' default: every ``full_attention_interval``-th is full
        interval = int(raw.get("full_attention_interval") or 4)
        kinds = [
            LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)
        ]
    kinds = tuple(str(kind) for kind in kinds)
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types names {len(kinds)} layers; the model has {num_layers}")
    unknown = set(kinds) - {FULL_ATTENTION, LINEAR_ATTENTION}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported")
    params = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1)
    spec = LinearAttentionSpec(
        layer_kinds=kinds,
        num_k_heads=int(raw["linear_num_key_heads"]),
        num_v_heads=int(raw["linear_num_value_heads"]),
        head_k_dim=int(raw["linear_key_head_dim"]),
        head_v_dim=int(raw["linear_value_head_dim"]),
        conv_kernel=int(raw.get("linear_conv_kernel_dim") or 4),
        rotary_dim=int(head_dim * factor),
        qkvz_grouped=family == "qwen3_next",
    )
    if spec.num_v_heads % spec.num_k_heads:
        raise ValueError(
            f"{spec.num_v_heads} linear value heads do not group over {spec.num_k_heads} key heads"
        )
    if spec.conv_kernel < 2 or spec.rotary_dim % 2:
        raise ValueError(f"conv kernel {spec.conv_kernel} / rotary dim {spec.rotary_dim} unusable")
    return spec
