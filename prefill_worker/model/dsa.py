"""DeepSeek-V3.2 and GLM-5: the DeepSeek-V3 decoder (``model.deepseek``) whose MLA attends
over the keys a lightning indexer picks (DeepSeek sparse attention, DSA)::

    per layer:  h = norm(x);  q, pool rows, q_lora = mla_project(h)   (rows -> the MLA pool)
                indexed layer:  q_idx = wq_b(q_lora)                       [T, Hi, Di]
                                k_idx = LayerNorm(wk(h))                   [T, Di] -> index cache
                                (the first qk_rope_head_dim of both roped)
                                w     = weights_proj(h) * Hi ** -0.5      [T, Hi] fp32
                                        (the projection in weights_proj's dtype, as transformers)
                                keep  = top-k per query (``attention.sdpa_dsa``)
                shared layer (GLM-5):  keep of the previous indexed layer
                x += o(attention over the latents under keep);  x += mlp(norm(x))

The indexer's keys live in the ``IndexCache`` beside the MLA pool (same pages), so a later
chunk or a prefix hit reads both back. Under tensor parallelism only MLA's query heads split
(``sharding.DSA_INDEXER``): the indexer is replicated, so every rank writes the same index
keys and keeps the same top-k. The indexer is transformers' arithmetic (unquantized, no
Hadamard rotation: an orthogonal transform that leaves the scores as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.attention.sdpa_dsa import DSASdpaBackend
from prefill_worker.model.deepseek import DeepseekV3LM, MLAModelWeights
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.index_cache import IndexCache
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm
from prefill_worker.model.llama import ForwardInputs
from prefill_worker.model.mla import mla_project
from prefill_worker.model.moe import ExpertsBackend
from prefill_worker.model.parallel import SINGLE, TPGroup, row_parallel

INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (a LayerNorm with bias), as transformers builds it


@dataclass(frozen=True, slots=True, eq=False)
class IndexerWeights:
    wq_b: torch.Tensor  # [Hi Di, q_lora_rank]
    wk: torch.Tensor  # [Di, hidden]
    k_norm: torch.Tensor  # [Di]
    k_norm_bias: torch.Tensor  # [Di]
    weights_proj: torch.Tensor  # [Hi, hidden], the model's dtype (fp16 models: fp32)


@dataclass(frozen=True, slots=True, eq=False)
class DSAModelWeights(MLAModelWeights):
    indexers: tuple[IndexerWeights | None, ...]  # per layer; None: a shared layer (GLM-5)


class DeepseekV32LM(DeepseekV3LM):
    """``DeepseekV3LM`` with the indexer; writes the index keys into ``index_cache``."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: DSAModelWeights,
        index_cache: IndexCache,
        tp: TPGroup = SINGLE,
        experts: ExpertsBackend | None = None,
    ) -> None:
        assert spec.indexer is not None, "DeepseekV32LM needs an indexer spec"
        super().__init__(spec, weights, tp, experts)
        self.indexer, self.index_cache = spec.indexer, index_cache
        self.indexers = weights.indexers

    def decode(
        self,
        x: torch.Tensor,  # [T, hidden], the residual, updated in place
        inputs: ForwardInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Every layer over ``x``; latent rows to the pool, index keys to the index cache."""
        assert isinstance(attention, DSASdpaBackend), "a DSA model needs the DSA backend"
        eps, mla, num_tokens = self.spec.rms_norm_eps, self.mla, x.shape[0]
        cos, sin = self.rotary.cos_sin(inputs.positions, self.dtype)  # [T, 1, rope/2] each
        rope = (self.rotary, cos, sin)
        keep: tuple[torch.Tensor | None, ...] = ()  # per chunk (``DSASdpaBackend.select``)
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, eps)
            q, rows, q_lora = mla_project(h, layer.attn, mla, eps, rope)
            rank = mla.kv_lora_rank
            kv_cache.write_latent(index, inputs.slots, rows[:, :rank], rows[:, rank:])
            indexer = self.indexers[index]
            if indexer is not None:
                assert q_lora is not None  # hf_dsa refuses a DSA config without q_lora_rank
                keep = self._select(index, indexer, h, q_lora, inputs.slots, rope, attention)
            out = q.new_empty(num_tokens, q.shape[1], mla.v_head_dim)
            attention.attend_sparse(q, rows, kv_cache.k[index], layer.attn.kv_b, mla, keep, out)
            x.add_(row_parallel(out.reshape(num_tokens, -1), layer.attn.o, None, self.tp))
            h = rms_norm(x, layer.post_norm, eps)
            x.add_(self._mlp(layer.mlp, h))
        return x

    def _select(
        self,
        layer: int,
        w: IndexerWeights,
        h: torch.Tensor,  # [T, hidden], the input-normed residual
        q_lora: torch.Tensor,  # [T, q_lora_rank], normed
        slots: torch.Tensor,  # [T], the tokens' pool rows
        rope: tuple[Rotary, torch.Tensor, torch.Tensor],  # the rotary, cos and sin
        attention: DSASdpaBackend,
    ) -> tuple[torch.Tensor | None, ...]:
        """The layer's index keys into the cache; each chunk's mask (``select``)."""
        rotary, cos, sin = rope
        spec, num_tokens, eps = self.indexer, h.shape[0], INDEX_NORM_EPS
        q = F.linear(q_lora, w.wq_b).view(num_tokens, spec.num_heads, spec.head_dim)
        k = F.layer_norm(F.linear(h, w.wk), (spec.head_dim,), w.k_norm, w.k_norm_bias, eps)
        dim = self.mla.qk_rope_head_dim  # the first ``dim`` of each index head are roped
        apply = rotary.apply_interleaved_into if spec.rope_interleave else rotary.apply_into
        q_rot, k_rot = torch.empty_like(q[..., :dim]), torch.empty_like(k[:, None, :dim])
        apply(q[..., :dim], cos, sin, q_rot)
        apply(k[:, None, :dim], cos, sin, k_rot)
        q[..., :dim], k[:, :dim] = q_rot, k_rot[:, 0]
        self.index_cache.write(layer, slots, k)
        weights = F.linear(h.to(w.weights_proj.dtype), w.weights_proj).float()
        weights.mul_(spec.num_heads**-0.5)  # [T, Hi]
        pool = self.index_cache.layer_keys(layer)
        return attention.select(q, weights, k, pool, spec.topk)
