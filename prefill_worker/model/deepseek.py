"""The DeepSeek-V3 decoder over packed tokens: MLA attention (``model.mla``) and the DeepSeek
MoE block (``model.moe``), the first ``first_k_dense_replace`` layers dense::

    x = embed(ids)                                        [T, hidden]
    per layer:  x += o(mla(norm(x)))   (the layer's latent rows written into the pool)
                x += moe(norm(x))  or  silu(g) * u @ Wdown, [g|u] = norm(x) @ Wgu
    logits = norm(x[rows]) @ Wlm                          [R, vocab]

Same contract as ``llama.CausalLM`` (``forward``, ``token_logprobs``); the attention backend
must be an ``MLAAttentionBackend`` (``attention.MLA_BACKENDS``). Under tensor parallelism the
o and down projections (and the MoE block) sum over the ranks, one all-reduce each, as in the
Llama family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefill_worker.model.attention import AttentionBackend, MLAAttentionBackend
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
from prefill_worker.model.mla import MLAWeights, mla_attention
from prefill_worker.model.moe import ExpertsBackend, create_moe_backend
from prefill_worker.model.moe.block import MoEWeights, moe_mlp
from prefill_worker.model.parallel import SINGLE, TPGroup, row_parallel
from prefill_worker.model.quant.linear import linear
from prefill_worker.model.sharding import local_dims


@dataclass(frozen=True, slots=True, eq=False)
class MLALayerWeights:
    input_norm: torch.Tensor  # [hidden]
    attn: MLAWeights
    post_norm: torch.Tensor  # [hidden]
    mlp: DenseMLP | MoEWeights


@dataclass(frozen=True, slots=True, eq=False)
class MLAModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[MLALayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


class DeepseekV3LM:
    """Forward pass only; owns nothing but its weights and the rotary frequencies."""

    logprob_block_bytes = 64 << 20  # the fp32 logits of one block of prompt-logprob rows

    def __init__(
        self,
        spec: ModelSpec,
        weights: MLAModelWeights,
        tp: TPGroup = SINGLE,
        experts: ExpertsBackend | None = None,
    ) -> None:
        assert spec.mla is not None, "DeepseekV3LM needs an MLA spec"
        self.spec, self.mla, self.tp = spec, spec.mla, tp
        self.dtype = weights.embed.dtype
        self.experts = experts or create_moe_backend("auto", weights.embed.device, self.dtype)
        self.weights = prepared_experts(weights, self.experts)
        self.rotary = Rotary(spec.rope, self.mla.qk_rope_head_dim, weights.embed.device)
        self.local = local_dims(spec, tp)  # this rank's head and intermediate counts

    def forward(
        self, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> ForwardOutput:
        """Write every token's latent row into its pages; return the logits ``[R, vocab]``
        and the prompt logprobs ``[L]``."""
        return self.forward_with_hidden(inputs, kv_cache, attention)[0]

    def forward_with_hidden(
        self, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> tuple[ForwardOutput, torch.Tensor]:
        """``forward``, and the final residual ``[T, hidden]`` before the norm (a draft
        reads it, ``model.draft``)."""
        x = F.embedding(inputs.input_ids, self.weights.embed)  # [T, hidden], the residual
        x = self.decode(x, inputs, kv_cache, attention)
        block = max(1, self.logprob_block_bytes // (4 * self.spec.vocab_size))
        return forward_output(x, inputs, self._logits, block), x

    def decode(
        self,
        x: torch.Tensor,  # [T, hidden], the residual, updated in place
        inputs: ForwardInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Run every layer over the residual ``x``; the layers' latent rows go to the pool."""
        assert isinstance(attention, MLAAttentionBackend), "an MLA model needs the MLA backend"
        eps = self.spec.rms_norm_eps
        cos, sin = self.rotary.cos_sin(inputs.positions, self.dtype)  # [T, 1, rope/2] each
        rope = (self.rotary, cos, sin)
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, eps)
            cache = (kv_cache, index, inputs.slots)
            attn = mla_attention(h, layer.attn, self.mla, eps, rope, cache, attention)
            x.add_(row_parallel(attn.reshape(x.shape[0], -1), layer.attn.o, None, self.tp))
            h = rms_norm(x, layer.post_norm, eps)
            x.add_(self._mlp(layer.mlp, h))
        return x

    def _mlp(self, mlp: DenseMLP | MoEWeights, h: torch.Tensor) -> torch.Tensor:
        if isinstance(mlp, MoEWeights):
            assert self.spec.moe is not None  # the loader builds MoEWeights only then
            return moe_mlp(h, mlp, self.spec.moe, self.experts, self.tp)
        gate_up = linear(h, mlp.gate_up, mlp.gate_up_bias)
        return row_parallel(silu_and_mul_(gate_up), mlp.down, mlp.down_bias, self.tp)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weights.norm, self.spec.rms_norm_eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(hidden), self.weights.lm_head)
