"""DeepSeek-V3's multi-token-prediction layer ("NextN", ``num_nextn_predict_layers``) as a
draft: its weights, how they load, its draft-extend forward.

The checkpoint stores the layer after the target's last one, under ``model.layers.<N>.``
(N = ``num_hidden_layers``): ``enorm``, ``hnorm``, ``eh_proj``, one MLA + MoE decoder layer
and the shared head's norm and head; the embedding is the target's. Draft-extend runs over
the tokens of a target chunk, each shifted by one (token i+1 at position i; after the
prompt's last token, the first sampled token), with the target's final hidden state of
each position, after the target's norm (SGLang's convention: its DeepSeek model returns
normed states and the draft reads those)::

    e        = enorm(embed(shifted ids))                         [T, hidden]
    h        = hnorm(norm(target residual))                      [T, hidden]
    x        = eh_proj([e | h])                                  [T, hidden]
    x        = decoder layer(x)  (its latent rows into the draft pool)
    hidden   = shared_head.norm(x[rows])                         [R, hidden]
    probs    = softmax(hidden @ head^T)  (fp32)                  [R, vocab]
    topk_p, topk_index = top-k(probs)                            [R, k]

``hidden`` (post-norm, in the model's dtype), ``topk_p`` and ``topk_index`` are what an
SGLang decode reads as its first draft input (``output_hidden_states``, ``output_topk_p``,
``output_topk_index``); the pool rows are the decode's draft layer's KV. The layer runs as a
one-layer ``DeepseekV3LM`` over its own one-layer MLA pool, with the batch's attention
plan: its pool rows sit at the target's slots, in the draft pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from prefill_worker.kv.draft_rows import MAX_TOPK
from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.deepseek import DeepseekV3LM, MLALayerWeights, MLAModelWeights
from prefill_worker.model.hf_config import CheckpointError, ModelSpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import rms_norm
from prefill_worker.model.llama import ForwardInputs, ForwardOutput
from prefill_worker.model.loader import TensorSource, open_tensors
from prefill_worker.model.mla import fuse_mla, mla_shapes
from prefill_worker.model.moe import ExpertsBackend
from prefill_worker.model.moe.block import fuse_moe, moe_shapes
from prefill_worker.model.parallel import SINGLE, TPGroup
from prefill_worker.model.quant.backends import Fp8WeightBackend
from prefill_worker.model.quant.linear import Weight, linear


@dataclass(frozen=True, slots=True, eq=False)
class MTPWeights:
    enorm: torch.Tensor  # [hidden]
    hnorm: torch.Tensor  # [hidden]
    eh_proj: Weight  # [hidden, 2 hidden]: columns [embedding | target hidden]
    layer: MLALayerWeights
    head_norm: torch.Tensor  # [hidden], shared_head.norm
    head: torch.Tensor  # [vocab, hidden], shared_head.head


@dataclass(frozen=True, slots=True, eq=False)
class DraftProposal:
    """The draft's first proposal for each sampled chunk (``logits_rows``)."""

    topk_p: torch.Tensor  # [R, k] float32, descending
    topk_index: torch.Tensor  # [R, k] int64
    hidden: torch.Tensor  # [R, hidden] in the model's dtype, after shared_head.norm


def mtp_prefix(spec: ModelSpec) -> str:
    return f"model.layers.{spec.num_layers}."


def mtp_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the (first) MTP layer, with its shape."""
    assert spec.mla is not None and spec.moe is not None, "an MTP layer is DeepSeek-V3's"
    p, hidden = mtp_prefix(spec), spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        p + "enorm.weight": (hidden,),
        p + "hnorm.weight": (hidden,),
        p + "eh_proj.weight": (hidden, 2 * hidden),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "shared_head.norm.weight": (hidden,),
        p + "shared_head.head.weight": (spec.vocab_size, hidden),
    }
    shapes |= mla_shapes(spec.mla, hidden, spec.num_heads, p + "self_attn.")
    return shapes | moe_shapes(spec.moe, hidden, p + "mlp.")


def load_mtp(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
    fp8: Fp8WeightBackend | None = None,
) -> MTPWeights:
    """Read and check the MTP layer (rank ``tp.rank``'s slices; FP8 weights as ``fp8``
    makes them, the target's backend); ``CheckpointError`` when the checkpoint has none or a
    tensor is missing or misshapen."""
    if spec.mla is None or spec.moe is None or spec.num_nextn_layers < 1:
        raise CheckpointError(
            f"{spec.architecture}: the checkpoint has no MTP layer (num_nextn_predict_layers "
            f"is {spec.num_nextn_layers}); draft.kind 'mtp' needs DeepSeek-V3's"
        )
    source = open_tensors(model_dir, spec, dtype, device, tp, mtp_shapes(spec), fp8)
    return fuse_mtp(spec, source)


def fuse_mtp(spec: ModelSpec, source: TensorSource) -> MTPWeights:
    assert spec.mla is not None and spec.moe is not None
    p = mtp_prefix(spec)
    layer = MLALayerWeights(
        input_norm=source.get(p + "input_layernorm.weight"),
        attn=fuse_mla(spec.mla, source.get, p + "self_attn.", source.linear),
        post_norm=source.get(p + "post_attention_layernorm.weight"),
        mlp=fuse_moe(spec.moe, source.get, p + "mlp.", linear_weight=source.linear),
    )
    return MTPWeights(
        enorm=source.get(p + "enorm.weight"),
        hnorm=source.get(p + "hnorm.weight"),
        eh_proj=source.linear(p + "eh_proj.weight"),
        layer=layer,
        head_norm=source.get(p + "shared_head.norm.weight"),
        head=source.get(p + "shared_head.head.weight"),
    )


class MTPDraft:
    """Forward only; owns its weights (the embedding is the target's) and its top-k."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: MTPWeights,
        embed: torch.Tensor,  # [vocab, hidden], the target's
        topk: int,
        tp: TPGroup = SINGLE,
        experts: ExpertsBackend | None = None,
    ) -> None:
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"draft top-k {topk} is outside [1, {MAX_TOPK}]")
        self.spec, self.topk, self.embed = spec, topk, embed
        self.enorm, self.hnorm, self.eh_proj = weights.enorm, weights.hnorm, weights.eh_proj
        one_layer = MLAModelWeights(embed, (weights.layer,), weights.head_norm, weights.head)
        self.decoder = DeepseekV3LM(spec, one_layer, tp, experts)

    def target_forward(
        self,
        target: DeepseekV3LM,
        inputs: ForwardInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> tuple[ForwardOutput, torch.Tensor]:
        """The target's forward, and the states this draft reads: its final hidden state
        after its norm ``[T, hidden]``."""
        out, residual = target.forward_with_hidden(inputs, kv_cache, attention)
        return out, target.final_norm(residual)

    def extend(
        self,
        inputs: ForwardInputs,  # the shifted ids; the target's positions, slots, logits_rows
        target_hidden: torch.Tensor,  # [T, hidden], the target's, after its final norm
        kv_cache: KVCache,  # the draft's one-layer MLA pool
        attention: AttentionBackend,  # planned for this batch
    ) -> DraftProposal:
        """Write the draft layer's latent rows; return the proposal at ``logits_rows``."""
        eps = self.spec.rms_norm_eps
        e = rms_norm(F.embedding(inputs.input_ids, self.embed), self.enorm, eps)
        h = rms_norm(target_hidden, self.hnorm, eps)
        x = linear(torch.cat([e, h], dim=-1), self.eh_proj)  # [T, hidden]
        x = self.decoder.decode(x, inputs, kv_cache, attention)
        hidden = self.decoder.final_norm(x[inputs.logits_rows])  # [R, hidden]
        logits = F.linear(hidden, self.decoder.weights.lm_head).float()  # [R, vocab]
        topk_p, topk_index = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
        return DraftProposal(topk_p, topk_index, hidden)


def shifted_ids(
    input_ids: torch.Tensor,  # [T] int64, chunks packed back to back
    chunk_ends: torch.Tensor,  # [C] int64, each chunk's end row (exclusive)
    next_ids: torch.Tensor,  # [C] int64, the token after each chunk: the next prompt token,
    # or the first sampled token after the prompt's last chunk
) -> torch.Tensor:
    """The draft's input ids ``[T]``: every row holds the token after its own."""
    shifted = torch.roll(input_ids, -1)
    shifted[chunk_ends - 1] = next_ids
    return shifted
