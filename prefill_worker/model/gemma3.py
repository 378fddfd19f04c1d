"""The decoder of Gemma 3 (text) over packed tokens: local (sliding-window) and global layers
in the order ``SlidingSpec.layer_kinds`` gives, each with its own RoPE base::

    x = embed(ids) * sqrt(hidden)                           (the scale in the model's dtype)
    per layer:  q, k, v = norm(x) @ Wqkv;  q/k RMSNorm per head;  RoPE (local base on a
                sliding layer, the global rope on a full one);  K/V into the pool
                x += post_attn_norm(attend(q, pool, window of the layer) @ Wo)
                x += post_ffw_norm(gelu_tanh(h @ Wg) * (h @ Wu) @ Wd),  h = pre_ffw_norm(x)
    logits = norm(x[rows]) @ Wlm                            [R, vocab]

Every RMSNorm of the checkpoint scales by ``1 + weight``; the loader adds the 1 once. The
softmax scale is ``query_pre_attn_scalar ** -0.5``. Same contract as ``llama.CausalLM``; the
attention backend is ``attention.sinks``' (no sinks here). Under tensor parallelism
(``sharding.GEMMA3``) a rank runs its query and KV heads and its slice of the MLP; o and down
are row-parallel, so the post-attention and post-feed-forward norms see the whole sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.attention.sinks import SinkWindowBackend
from prefill_worker.model.hf_config import ModelSpec, RopeSpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm
from prefill_worker.model.llama import ForwardInputs, ForwardOutput, forward_output
from prefill_worker.model.parallel import SINGLE, TPGroup, row_parallel
from prefill_worker.model.sharding import local_dims


@dataclass(frozen=True, slots=True, eq=False)
class Gemma3LayerWeights:
    input_norm: torch.Tensor  # [hidden], 1 + the checkpoint's weight (every norm here)
    qkv: torch.Tensor  # [(H + 2 KV) D, hidden]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o: torch.Tensor  # [hidden, H D]
    post_attn_norm: torch.Tensor  # [hidden]
    pre_ffw_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden], gate rows first
    down: torch.Tensor  # [hidden, I]
    post_ffw_norm: torch.Tensor  # [hidden]


@dataclass(frozen=True, slots=True, eq=False)
class Gemma3ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[Gemma3LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


class Gemma3LM:
    """Forward pass only; owns its weights and both rotary tables."""

    logprob_block_bytes = 64 << 20

    def __init__(self, spec: ModelSpec, weights: Gemma3ModelWeights, tp: TPGroup = SINGLE) -> None:
        assert spec.sliding is not None and spec.sliding.local_rope_theta is not None
        self.spec, self.sliding, self.tp, self.weights = spec, spec.sliding, tp, weights
        self.dtype, device = weights.embed.dtype, weights.embed.device
        self.rotary = Rotary(spec.rope, spec.head_dim, device)
        local_rope = RopeSpec(theta=spec.sliding.local_rope_theta)
        self.local_rotary = Rotary(local_rope, spec.head_dim, device)
        self.local = local_dims(spec, tp)
        self.scale = spec.sliding.query_scale or spec.head_dim**-0.5
        self.embed_scale = torch.tensor(spec.hidden_size**0.5).to(device, self.dtype)

    def forward(
        self, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> ForwardOutput:
        """Write every layer's K/V into the pages; return the logits and prompt logprobs."""
        assert isinstance(attention, SinkWindowBackend), "Gemma 3 attends with windows"
        spec, eps = self.spec, self.spec.rms_norm_eps
        heads, kv_heads, dim = self.local.num_heads, self.local.num_kv_heads, spec.head_dim
        x = F.embedding(inputs.input_ids, self.weights.embed) * self.embed_scale
        num_tokens = x.shape[0]
        tables = {
            None: self.rotary.cos_sin(inputs.positions, self.dtype),
            "local": self.local_rotary.cos_sin(inputs.positions, self.dtype),
        }
        q = x.new_empty(num_tokens, heads, dim)
        k = x.new_empty(num_tokens, kv_heads, dim)
        attn = torch.empty_like(q)
        for index, layer in enumerate(self.weights.layers):
            window = self.sliding.window_of(index)
            rotary = self.rotary if window is None else self.local_rotary
            cos, sin = tables[None if window is None else "local"]
            qkv = F.linear(rms_norm(x, layer.input_norm, eps), layer.qkv)
            q_raw, k_raw, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q_normed = rms_norm(q_raw.reshape(num_tokens, heads, dim), layer.q_norm, eps)
            k_normed = rms_norm(k_raw.reshape(num_tokens, kv_heads, dim), layer.k_norm, eps)
            rotary.apply_into(q_normed, cos, sin, q)
            rotary.apply_into(k_normed, cos, sin, k)
            slots = inputs.slots_of(window)
            kv_cache.write(index, slots, k, v.reshape(num_tokens, kv_heads, dim))
            attention.attend_window(
                q, kv_cache.k[index], kv_cache.v[index], attn, window, None, self.scale
            )
            out = row_parallel(attn.view(num_tokens, heads * dim), layer.o, None, self.tp)
            x.add_(rms_norm(out, layer.post_attn_norm, eps))
            h = F.linear(rms_norm(x, layer.pre_ffw_norm, eps), layer.gate_up)
            gate, up = h.chunk(2, dim=-1)
            mlp = row_parallel(F.gelu(gate, approximate="tanh") * up, layer.down, None, self.tp)
            x.add_(rms_norm(mlp, layer.post_ffw_norm, eps))
        block = max(1, self.logprob_block_bytes // (4 * self.spec.vocab_size))
        return forward_output(x, inputs, self._logits, block)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        last = rms_norm(hidden, self.weights.norm, self.spec.rms_norm_eps)
        return F.linear(last, self.weights.lm_head)
