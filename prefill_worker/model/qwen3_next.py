"""The decoder of Qwen3-Next and Qwen3.5 over packed tokens: gated DeltaNet layers
(``model.gdn``, state in the state pool) and gated full-attention layers (K/V in the paged
pool) in the order ``layer_types`` gives, each followed by a dense MLP or (Qwen3-Next) a MoE
block with one sigmoid-gated shared expert::

    x = embed(ids)                                          [T, hidden]
    per layer:  h = norm(x)
                linear:  x += gdn(h)        (each chunk's state slot read and written)
                full:    [q|gate], k, v = h @ Wqkv;  q/k RMSNorm per head; RoPE on the
                         first rotary_dim of each head; K/V into the pool (layer i of the
                         pool is the i-th full layer); x += (attn * sigmoid(gate)) @ Wo
                x += mlp(norm(x))
    logits = norm(x[rows]) @ Wlm                            [R, vocab]

The checkpoints' RMSNorms scale by ``1 + weight``; the loader adds the 1 once, so the norms
here are the Llama family's. Same contract as ``llama.CausalLM`` (``forward``); the runner
passes each chunk's state slot in ``ForwardInputs.state_spans``.

Under tensor parallelism (``model.sharding``'s table) a rank runs its heads of every layer:
a linear layer's key heads and their value heads (its state pool holds those heads' conv
channels and recurrent matrices, ``sharding.local_linear``), a full layer's query heads
with their gates and its KV heads, its slice of every expert; the out, o and down
projections are row-parallel (one all-reduce each), as ``model.parallel`` draws. After a
forward the slots of the prompts it finished are gathered whole on the leader
(``model.state_gather``), whose transfer sends them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.gdn import TORCH_RULE, DeltaRule, GDNWeights, gated_delta_net
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm, silu_and_mul_
from prefill_worker.model.llama import (
    DenseMLP,
    ForwardInputs,
    ForwardOutput,
    forward_output,
    prepared_experts,
)
from prefill_worker.model.moe import ExpertsBackend, create_moe_backend
from prefill_worker.model.moe.block import MoEWeights, moe_mlp
from prefill_worker.model.parallel import SINGLE, TPGroup, row_parallel
from prefill_worker.model.quant.linear import linear
from prefill_worker.model.sharding import local_dims, local_linear
from prefill_worker.model.state_cache import StateCache
from prefill_worker.model.state_gather import StateGather


@dataclass(frozen=True, slots=True, eq=False)
class GatedAttentionWeights:
    qkv: torch.Tensor  # [H * 2D + 2 KV D, hidden]: per head [q | gate], then k, then v
    o: torch.Tensor  # [hidden, H D]
    q_norm: torch.Tensor  # [D], 1 + the checkpoint's weight
    k_norm: torch.Tensor  # [D]


@dataclass(frozen=True, slots=True, eq=False)
class HybridLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    mixer: GatedAttentionWeights | GDNWeights
    post_norm: torch.Tensor  # [hidden]
    mlp: DenseMLP | MoEWeights


@dataclass(frozen=True, slots=True, eq=False)
class HybridModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[HybridLayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


class Qwen3NextLM:
    """Forward pass only; owns its weights and rotary frequencies, and reads and writes the
    state pool it is given (the runner's chunks name the slots)."""

    logprob_block_bytes = 64 << 20  # the fp32 logits of one block of prompt-logprob rows

    def __init__(
        self,
        spec: ModelSpec,
        weights: HybridModelWeights,
        state: StateCache,
        tp: TPGroup = SINGLE,
        experts: ExpertsBackend | None = None,
        gather: StateGather | None = None,
        delta_rule: DeltaRule = TORCH_RULE,
        kernel_paths: tuple[str, ...] = (),
    ) -> None:
        assert spec.linear is not None, "Qwen3NextLM needs a hybrid spec"
        self.gather = gather  # TP > 1: finished slots, whole, into the leader's pool
        self.spec, self.linear, self.tp, self.state = spec, local_linear(spec.linear, tp), tp, state
        self.delta_rule = delta_rule  # gdn_rule's choice: torch, or flashinfer's kernel
        self.kernel_paths = kernel_paths  # which, and why (ModelInfo.kernel_paths)
        self.dtype = weights.embed.dtype
        self.experts = experts or create_moe_backend("auto", weights.embed.device, self.dtype)
        self.weights = prepared_experts(weights, self.experts)
        self.rotary = Rotary(spec.rope, self.linear.rotary_dim, weights.embed.device)
        self.local = local_dims(spec, tp)
        self._slot_layer = {layer: i for i, layer in enumerate(self.linear.linear_layers)}
        self._pool_layer = {layer: i for i, layer in enumerate(self.linear.full_layers)}

    def forward(
        self, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> ForwardOutput:
        """Write the full layers' K/V into pages and the linear layers' state into the
        chunks' slots; return the logits ``[R, vocab]`` and the prompt logprobs ``[L]``."""
        eps = self.spec.rms_norm_eps
        x = F.embedding(inputs.input_ids, self.weights.embed)  # [T, hidden], the residual
        cos, sin = self.rotary.cos_sin(inputs.positions, self.dtype)  # [T, 1, rotary/2] each
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, eps)
            if isinstance(layer.mixer, GDNWeights):
                slot_layer = self._slot_layer[index]
                conv, recurrent = self.state.conv[slot_layer], self.state.recurrent[slot_layer]
                spans = inputs.state_spans
                mixed = gated_delta_net(
                    h, layer.mixer, self.linear, eps, spans, conv, recurrent, self.tp,
                    self.delta_rule,
                )  # fmt: skip
                x.add_(mixed)
            else:
                cache = (kv_cache, self._pool_layer[index], inputs.slots)
                x.add_(self._attention(h, layer.mixer, cos, sin, cache, attention))
            x.add_(self._mlp(layer.mlp, rms_norm(x, layer.post_norm, eps)))
        if self.gather is not None:
            self.gather.gather(inputs.state_spans)
        block = max(1, self.logprob_block_bytes // (4 * self.spec.vocab_size))
        return forward_output(x, inputs, self._logits, block)

    def _attention(
        self,
        h: torch.Tensor,  # [T, hidden]
        w: GatedAttentionWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[KVCache, int, torch.Tensor],
        attention: AttentionBackend,
    ) -> torch.Tensor:
        spec, eps, (kv_cache, pool_layer, slots) = self.spec, self.spec.rms_norm_eps, cache
        num_tokens, heads, kv_heads, dim = (
            h.shape[0],
            self.local.num_heads,
            self.local.num_kv_heads,
            spec.head_dim,
        )
        qkv = F.linear(h, w.qkv)
        q_gate = qkv[:, : 2 * heads * dim].view(num_tokens, heads, 2 * dim)
        k = qkv[:, 2 * heads * dim : (2 * heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
        v = qkv[:, (2 * heads + kv_heads) * dim :].reshape(num_tokens, kv_heads, dim)
        q = self._rope(rms_norm(q_gate[..., :dim], w.q_norm, eps), cos, sin)  # [T, H, D]
        k = self._rope(rms_norm(k, w.k_norm, eps), cos, sin)  # [T, KV, D]
        kv_cache.write(pool_layer, slots, k, v)
        out = torch.empty_like(q)
        attention.attend(q, k, v, kv_cache.k[pool_layer], kv_cache.v[pool_layer], out)
        gate = q_gate[..., dim:].sigmoid()  # [T, H, D]
        return row_parallel((out * gate).reshape(num_tokens, heads * dim), w.o, None, self.tp)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, D]`` with its first ``rotary_dim`` rotated, the rest as it was."""
        out = x.clone()
        rotary = self.linear.rotary_dim
        self.rotary.apply_into(x[..., :rotary], cos, sin, out[..., :rotary])
        return out

    def _mlp(self, mlp: DenseMLP | MoEWeights, h: torch.Tensor) -> torch.Tensor:
        if isinstance(mlp, MoEWeights):
            assert self.spec.moe is not None  # the loader builds MoEWeights only then
            return moe_mlp(h, mlp, self.spec.moe, self.experts, self.tp)
        return row_parallel(silu_and_mul_(linear(h, mlp.gate_up)), mlp.down, None, self.tp)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        last = rms_norm(hidden, self.weights.norm, self.spec.rms_norm_eps)
        return F.linear(last, self.weights.lm_head)
