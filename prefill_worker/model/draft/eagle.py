"""EAGLE and EAGLE-3 drafts for a Llama-family target: a separate draft checkpoint (one Llama
decoder layer and a projection of the target's hidden states), as SGLang 0.5.23 loads and runs
them (its ``llama_eagle.py``, ``llama_eagle3.py``), and their draft-extend forward.

Draft-extend runs over a target chunk's tokens each shifted by one (token i+1 at position i;
after the prompt's last token, the first sampled token), with target states captured from the
target's forward of the same chunk::

    EAGLE (kind "eagle"): the target's final hidden state, after its norm    [T, H]
    x      = fc([embed(ids) | state]) + fc_bias                             [T, H]
    x     += attn(x)        (no input norm: EAGLE's first layer has none)
    x     += mlp(post_norm(x))
    logits = x @ target lm_head^T                                           [T, vocab]
    hidden = x   (the layer's output: this draft has no final norm)

    EAGLE-3 (kind "eagle3"): the residual stream entering the target's layers
    ``aux_layers`` (SGLang's ``layers_to_capture``: eagle_aux_hidden_state_layer_ids + 1, by
    default 2, L/2, L-3), concatenated low | mid | high                     [T, 3 H]
    r      = fc(states)                                                     [T, H]
    x      = [input_norm(embed(ids)) | hidden_norm(r)]                      [T, 2 H]
    r     += attn(x)        (q, k, v project from 2 H)
    r     += mlp(post_norm(r))
    logits = norm(r) @ lm_head^T                                            [T, draft vocab]
    hidden = r   (before the norm: SGLang's ``hidden_states_to_aux`` unless ``norm_output``)

The embedding is the target's (SGLang shares it); the proposal is ``softmax(logits)``'s top-k
(fp32). EAGLE-3's top-k ids are the draft vocabulary's: the decode maps them to target ids
itself (``hot_token_id[topk_index]``, from the checkpoint's ``d2t``), so they are sent as the
draft computed them. The layer's K/V go to a one-layer pool of the target's page geometry, at
the target's slots.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from prefill_worker.kv.draft_rows import MAX_TOPK
from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.draft.mtp import DraftProposal
from prefill_worker.model.hf_config import CheckpointError, ModelSpec, spec_from_dict
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm, silu_and_mul_
from prefill_worker.model.llama import CausalLM, ForwardInputs, ForwardOutput
from prefill_worker.model.loader import TensorSource, open_tensors, tensor_files
from prefill_worker.model.parallel import (
    SINGLE,
    TPGroup,
    even_range,
    kv_head_range,
    q_head_range,
    row_parallel,
)
from prefill_worker.model.sharding import local_dims

EAGLE_KINDS = ("eagle", "eagle3")
_LEGACY_LAYER = "midlayer."  # EAGLE-3's first checkpoints name the layer so (SGLang maps it)


@dataclass(frozen=True, slots=True)
class EagleConfig:
    kind: str  # "eagle" or "eagle3"
    spec: ModelSpec  # the draft's decoder layer, read as a Llama config
    draft_vocab_size: int  # the LM head's rows (EAGLE: the target's vocabulary)
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose input it reads; EAGLE: ()
    has_fc_bias: bool
    norm_output: bool  # EAGLE-3: the row carries the normed state, not the pre-norm one
    layer_prefix: str  # "layers.0." or "midlayer."


@dataclass(frozen=True, slots=True, eq=False)
class EagleWeights:
    fc: torch.Tensor  # [H, 2 H] (EAGLE: [embedding | state]) or [H, n H] (EAGLE-3)
    fc_bias: torch.Tensor | None  # [H]
    input_norm: torch.Tensor | None  # [H], EAGLE-3's embedding norm
    hidden_norm: torch.Tensor | None  # [H], EAGLE-3's state norm
    qkv: torch.Tensor  # [(heads + 2 kv heads) D, H or 2 H]
    o: torch.Tensor  # [H, heads D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H], gate rows first
    down: torch.Tensor  # [H, I]
    norm: torch.Tensor | None  # [H], EAGLE-3's final norm
    lm_head: torch.Tensor  # [draft vocab, H]


def read_eagle_config(draft_dir: str | Path, kind: str, target: ModelSpec) -> EagleConfig:
    """The draft checkpoint's config.json, checked against the target; ``CheckpointError``
    when it does not fit."""
    path = Path(draft_dir) / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        spec = spec_from_dict(raw | {"architectures": ["LlamaForCausalLM"]})
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not an EAGLE draft's config: {exc}") from exc
    eagle = raw.get("eagle_config") or {}
    for flag in ("norm_before_fc", "fc_norm", "use_aux_norm"):
        if eagle.get(flag) or raw.get(flag):
            raise CheckpointError(f"{path}: {flag} is not supported")
    if raw.get("target_hidden_size", spec.hidden_size) != target.hidden_size:
        raise CheckpointError(f"{path}: its target's hidden size is not {target.hidden_size}")
    aux_layers: tuple[int, ...] = ()
    if kind == "eagle3":
        aux_layers = _aux_layers(eagle.get("eagle_aux_hidden_state_layer_ids"), target.num_layers)
    vocab = raw.get("draft_vocab_size") if kind == "eagle3" else None
    return EagleConfig(
        kind=kind,
        spec=spec,
        draft_vocab_size=int(vocab or target.vocab_size),
        aux_layers=aux_layers,
        has_fc_bias=kind == "eagle" or bool(raw.get("bias", False)),
        norm_output=bool(raw.get("norm_output", False)),
        layer_prefix="layers.0.",
    )


def _aux_layers(layer_ids: list[int] | None, num_layers: int) -> tuple[int, ...]:
    """SGLang's ``set_eagle3_layers_to_capture``: the input of layer id + 1 for each id."""
    layers = (
        (2, num_layers // 2, num_layers - 3) if layer_ids is None else [i + 1 for i in layer_ids]
    )
    if not all(0 <= i < num_layers for i in layers):
        raise CheckpointError(f"EAGLE-3 reads layers {list(layers)} of a {num_layers}-layer target")
    return tuple(layers)


def eagle_shapes(config: EagleConfig, target: ModelSpec) -> dict[str, tuple[int, ...]]:
    s, p = config.spec, config.layer_prefix
    hidden, width = s.hidden_size, s.head_dim
    layer_in = 2 * hidden if config.kind == "eagle3" else hidden
    fc_in = target.hidden_size * len(config.aux_layers) if config.aux_layers else 2 * hidden
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, fc_in),
        p + "self_attn.q_proj.weight": (s.num_heads * width, layer_in),
        p + "self_attn.k_proj.weight": (s.num_kv_heads * width, layer_in),
        p + "self_attn.v_proj.weight": (s.num_kv_heads * width, layer_in),
        p + "self_attn.o_proj.weight": (hidden, s.num_heads * width),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "mlp.gate_proj.weight": (s.intermediate_size, hidden),
        p + "mlp.up_proj.weight": (s.intermediate_size, hidden),
        p + "mlp.down_proj.weight": (hidden, s.intermediate_size),
    }
    if config.has_fc_bias:
        shapes["fc.bias"] = (hidden,)
    if config.kind == "eagle3":
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "hidden_norm.weight": (hidden,),
            "norm.weight": (hidden,),
        }
    return shapes


def load_eagle(
    draft_dir: str | Path,
    config: EagleConfig,
    target: CausalLM,
    device: torch.device,
) -> EagleWeights:
    """Read and check the draft's tensors (``CheckpointError`` for one missing or misshapen),
    whole (one layer), and keep the target's rank's slices (``target.tp``); the LM head is
    the draft's own where the checkpoint has one (EAGLE-3), else the target's."""
    root = Path(draft_dir)
    names = tensor_files(root)
    if _LEGACY_LAYER + "post_attention_layernorm.weight" in names:
        config = dataclasses.replace(config, layer_prefix=_LEGACY_LAYER)
    shapes = eagle_shapes(config, target.spec)
    has_head = config.kind == "eagle3" and "lm_head.weight" in names
    if has_head:
        shapes["lm_head.weight"] = (config.draft_vocab_size, config.spec.hidden_size)
    elif config.draft_vocab_size != target.spec.vocab_size:
        raise CheckpointError(f"{root}: a draft vocabulary of its own needs its lm_head.weight")
    source = open_tensors(root, config.spec, target.dtype, device, SINGLE, shapes)
    lm_head = source.get("lm_head.weight") if has_head else target.weights.lm_head
    return fuse_eagle(config, source, lm_head, target.tp)


def fuse_eagle(
    config: EagleConfig, r: TensorSource, lm_head: torch.Tensor, tp: TPGroup = SINGLE
) -> EagleWeights:
    """The draft's tensors, by checkpoint name, fused; rank ``tp.rank``'s slices of the layer
    (split like the target's: q/k/v and gate/up by rows, o and down by columns, the rest
    replicated)."""
    p, is_3, s = config.layer_prefix, config.kind == "eagle3", config.spec
    attn, mlp = p + "self_attn.", p + "mlp."
    q = _heads(r.get(attn + "q_proj.weight"), q_head_range(s.num_heads, tp), s.head_dim)
    kv = kv_head_range(s.num_kv_heads, tp)
    k, v = (_heads(r.get(f"{attn}{n}_proj.weight"), kv, s.head_dim) for n in "kv")
    heads = q_head_range(s.num_heads, tp)
    o = r.get(attn + "o_proj.weight")[:, heads.start * s.head_dim : heads.stop * s.head_dim]
    width = even_range(s.intermediate_size, tp)
    gate, up = (r.get(f"{mlp}{n}_proj.weight")[width.start : width.stop] for n in ("gate", "up"))
    return EagleWeights(
        fc=r.get("fc.weight"),
        fc_bias=r.maybe("fc.bias", config.has_fc_bias),
        input_norm=r.maybe(p + "input_layernorm.weight", is_3),
        hidden_norm=r.maybe(p + "hidden_norm.weight", is_3),
        qkv=torch.cat([q, k, v]),
        o=o.contiguous(),
        post_norm=r.get(p + "post_attention_layernorm.weight"),
        gate_up=torch.cat([gate, up]),
        down=r.get(mlp + "down_proj.weight")[:, width.start : width.stop].contiguous(),
        norm=r.maybe("norm.weight", is_3),
        lm_head=lm_head,
    )


def _heads(rows: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    """The rows of ``heads``, ``head_dim`` each."""
    return rows[heads.start * head_dim : heads.stop * head_dim]


class EagleDraft:
    """Forward only; owns its weights (the embedding and, for EAGLE, the head are the
    target's) and its top-k."""

    def __init__(self, config: EagleConfig, weights: EagleWeights, target: CausalLM, topk: int):
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"draft top-k {topk} is outside [1, {MAX_TOPK}]")
        self.config, self.spec, self.topk, self.tp = config, config.spec, topk, target.tp
        self.local = local_dims(config.spec, target.tp)  # this rank's heads and MLP width
        self.weights, self.embed = weights, target.weights.embed
        self.target_norm, self.target_eps = target.weights.norm, target.spec.rms_norm_eps
        self.rotary = Rotary(config.spec.rope, config.spec.head_dim, self.embed.device)

    def target_forward(
        self,
        target: CausalLM,
        inputs: ForwardInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> tuple[ForwardOutput, torch.Tensor]:
        """The target's forward, and the states this draft reads ``[T, n H]``."""
        if self.config.kind == "eagle3":
            out, states = target.forward_with_states(
                inputs, kv_cache, attention, self.config.aux_layers
            )
            return out, torch.cat(states, dim=-1)
        last = len(target.weights.layers)
        out, (residual,) = target.forward_with_states(inputs, kv_cache, attention, (last,))
        return out, rms_norm(residual, self.target_norm, self.target_eps)

    def extend(
        self,
        inputs: ForwardInputs,  # the shifted ids; the target's positions, slots, logits_rows
        states: torch.Tensor,  # [T, n H], from ``target_forward``
        kv_cache: KVCache,  # the draft's one-layer pool
        attention: AttentionBackend,  # planned for this batch
    ) -> DraftProposal:
        """Write the draft layer's K/V; return the proposal at ``logits_rows``."""
        w, eps = self.weights, self.spec.rms_norm_eps
        e = F.embedding(inputs.input_ids, self.embed)  # [T, H]
        if self.config.kind == "eagle3":
            assert w.input_norm is not None and w.hidden_norm is not None
            r = F.linear(states, w.fc, w.fc_bias)  # [T, H]
            x = torch.cat([rms_norm(e, w.input_norm, eps), rms_norm(r, w.hidden_norm, eps)], -1)
        else:
            r = F.linear(torch.cat([e, states], dim=-1), w.fc, w.fc_bias)  # [T, H]
            x = r
        r = r + self._attention(x, inputs, kv_cache, attention)
        gate_up = F.linear(rms_norm(r, w.post_norm, eps), w.gate_up)  # [T, 2 I]
        r = r + row_parallel(silu_and_mul_(gate_up), w.down, None, self.tp)
        rows = r[inputs.logits_rows]  # [R, H]
        normed = rows if w.norm is None else rms_norm(rows, w.norm, eps)
        logits = F.linear(normed, w.lm_head).float()  # [R, draft vocab]
        topk_p, topk_index = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
        return DraftProposal(topk_p, topk_index, normed if self.config.norm_output else rows)

    def _attention(
        self, x: torch.Tensor, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> torch.Tensor:
        """``o(attention(q, k, v))`` of ``x [T, in]``, the K/V into the pool's one layer."""
        local, head_dim, num_tokens = self.local, self.spec.head_dim, x.shape[0]
        q_dim, kv_dim = local.num_heads * head_dim, local.num_kv_heads * head_dim
        qkv = F.linear(x, self.weights.qkv)  # [T, (heads + 2 kv heads) D], this rank's heads
        cos, sin = self.rotary.cos_sin(inputs.positions, x.dtype)
        q = x.new_empty(num_tokens, local.num_heads, head_dim)
        k = x.new_empty(num_tokens, local.num_kv_heads, head_dim)
        self.rotary.apply_into(qkv[:, :q_dim].view(q.shape), cos, sin, q)
        self.rotary.apply_into(qkv[:, q_dim : q_dim + kv_dim].view(k.shape), cos, sin, k)
        v = qkv[:, q_dim + kv_dim :].reshape(k.shape)
        kv_cache.write(0, inputs.slots, k, v)
        out = torch.empty_like(q)
        attention.attend(q, k, v, kv_cache.k[0], kv_cache.v[0], out)
        return row_parallel(out.reshape(num_tokens, q_dim), self.weights.o, None, self.tp)
