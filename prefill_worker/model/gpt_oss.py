"""The decoder of gpt-oss over packed tokens: attention with biases and per-head sinks,
sliding-window on the layers ``SlidingSpec`` names, YaRN RoPE, and a MoE MLP on every layer::

    x = embed(ids)                                          [T, hidden]
    per layer:  q, k, v = norm(x) @ Wqkv + b;  RoPE;  K/V into the pool (every layer)
                x += attend(q, pool, window of the layer, sinks) @ Wo + bo
                h = norm(x);  top-k of (h @ Wr + br), softmax over the k
                x += sum_k w_k * (clamped_swiglu(h @ Wgu_e + bgu_e) @ Wd_e + bd_e)
    logits = norm(x[rows]) @ Wlm                            [R, vocab]

The clamped SwiGLU: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
``(up + 1) * gate * sigmoid(alpha * gate)``. The experts run one at a time over the tokens
routed to them (each expert's weights read once per layer), or, for MXFP4 experts kept as
shipped (``GptOssMxfp4Experts``: an SM90 GPU with flashinfer at TP 1, ``moe.mxfp4``'s
choice), in one call of flashinfer's W4A16 MoE per layer (``moe.flashinfer_mxfp4``). Same
contract as ``llama.CausalLM`` (``forward``); the attention backend is ``attention.sinks``'.

Under tensor parallelism (``sharding.GPT_OSS``) a rank runs its query heads with their sinks
and its KV heads, and every expert's slice of the intermediate dimension; o is row-parallel
(its bias added once, after the all-reduce), and the MoE block's partial sum is all-reduced
once, each expert's down bias carried by rank 0's partial sum alone (the others' are zero).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.attention.sinks import SinkWindowBackend
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm
from prefill_worker.model.llama import ForwardInputs, ForwardOutput, forward_output
from prefill_worker.model.moe.flashinfer_mxfp4 import FlashInferMxfp4Experts, PreparedMxfp4
from prefill_worker.model.moe.mxfp4 import Mxfp4Stack
from prefill_worker.model.parallel import SINGLE, TPGroup, all_reduce_, row_parallel
from prefill_worker.model.sharding import local_dims


@dataclass(frozen=True, slots=True, eq=False)
class GptOssExperts:
    router: torch.Tensor  # [E, hidden]
    router_bias: torch.Tensor  # [E]
    gate_up: torch.Tensor  # [E, 2I, hidden]: gate rows, then up rows
    gate_up_bias: torch.Tensor  # [E, 2I]
    down: torch.Tensor  # [E, hidden, I]
    down_bias: torch.Tensor  # [E, hidden]


@dataclass(frozen=True, slots=True, eq=False)
class GptOssMxfp4Experts:
    """The experts as shipped (``stacks``: gate_up's and down's, packed for the kernel), then,
    once ``GptOssLM`` prepared them on the GPU, ``prepared`` in their place."""

    router: torch.Tensor  # [E, hidden]
    router_bias: torch.Tensor  # [E]
    stacks: tuple[Mxfp4Stack, Mxfp4Stack] | None
    prepared: PreparedMxfp4 | None = None


@dataclass(frozen=True, slots=True, eq=False)
class GptOssLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 KV) D, hidden]
    qkv_bias: torch.Tensor  # [(H + 2 KV) D]
    o: torch.Tensor  # [hidden, H D]
    o_bias: torch.Tensor  # [hidden]
    sinks: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [hidden]
    experts: GptOssExperts | GptOssMxfp4Experts


@dataclass(frozen=True, slots=True, eq=False)
class GptOssModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[GptOssLayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


class GptOssLM:
    """Forward pass only; owns its weights and rotary frequencies."""

    logprob_block_bytes = 64 << 20  # the fp32 logits of one block of prompt-logprob rows

    def __init__(
        self,
        spec: ModelSpec,
        weights: GptOssModelWeights,
        tp: TPGroup = SINGLE,
        kernel_paths: tuple[str, ...] = (),
    ) -> None:
        assert spec.sliding is not None, "GptOssLM needs a sliding spec"
        self.spec, self.sliding, self.tp = spec, spec.sliding, tp
        self.kernel_paths = kernel_paths  # which experts path, and why (ModelInfo.kernel_paths)
        self.mxfp4: FlashInferMxfp4Experts | None = None
        if any(isinstance(layer.experts, GptOssMxfp4Experts) for layer in weights.layers):
            assert tp.is_single, "MXFP4 experts are kept at tensor parallel 1 only"
            self.mxfp4 = FlashInferMxfp4Experts(
                spec.sliding.swiglu_alpha, spec.sliding.swiglu_limit
            )
            weights = replace(weights, layers=tuple(map(self._prepared, weights.layers)))
        self.weights = weights if tp.rank == 0 else _without_down_bias(weights)
        self.dtype = weights.embed.dtype
        self.rotary = Rotary(spec.rope, spec.head_dim, weights.embed.device)
        self.local = local_dims(spec, tp)
        self.scale = spec.head_dim**-0.5

    def forward(
        self, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> ForwardOutput:
        """Write every layer's K/V into the pages; return the logits ``[R, vocab]`` and the
        prompt logprobs ``[L]``. ``attention`` is the ``SinkWindowBackend`` ``create_model``
        pairs with this family."""
        assert isinstance(attention, SinkWindowBackend), "gpt-oss attends with sinks"
        spec, eps, tp = self.spec, self.spec.rms_norm_eps, self.tp
        heads, kv_heads, dim = self.local.num_heads, self.local.num_kv_heads, spec.head_dim
        x = F.embedding(inputs.input_ids, self.weights.embed)  # [T, hidden], the residual
        num_tokens = x.shape[0]
        cos, sin = self.rotary.cos_sin(inputs.positions, self.dtype)  # [T, 1, D/2] each
        q = x.new_empty(num_tokens, heads, dim)
        k = x.new_empty(num_tokens, kv_heads, dim)
        attn = torch.empty_like(q)
        for index, layer in enumerate(self.weights.layers):
            qkv = F.linear(rms_norm(x, layer.input_norm, eps), layer.qkv, layer.qkv_bias)
            q_raw, k_raw, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            self.rotary.apply_into(q_raw.view(num_tokens, heads, dim), cos, sin, q)
            self.rotary.apply_into(k_raw.view(num_tokens, kv_heads, dim), cos, sin, k)
            window = self.sliding.window_of(index)
            slots = inputs.slots_of(window)
            kv_cache.write(index, slots, k, v.reshape(num_tokens, kv_heads, dim))
            attention.attend_window(
                q, kv_cache.k[index], kv_cache.v[index], attn, window, layer.sinks, self.scale
            )
            x.add_(row_parallel(attn.view(num_tokens, heads * dim), layer.o, layer.o_bias, tp))
            x.add_(all_reduce_(self._moe(layer.experts, rms_norm(x, layer.post_norm, eps)), tp))
        block = max(1, self.logprob_block_bytes // (4 * self.spec.vocab_size))
        return forward_output(x, inputs, self._logits, block)

    def _prepared(self, layer: GptOssLayerWeights) -> GptOssLayerWeights:
        """The layer with its packed experts in the kernel's interleave (the packed copy let go)."""
        experts = layer.experts
        if not isinstance(experts, GptOssMxfp4Experts) or experts.stacks is None:
            return layer
        assert self.mxfp4 is not None
        prepared = self.mxfp4.prepare(*experts.stacks)
        kept = replace(experts, stacks=None, prepared=prepared)
        return replace(layer, experts=kept)

    def _moe(self, w: GptOssExperts | GptOssMxfp4Experts, h: torch.Tensor) -> torch.Tensor:
        """``h [T, hidden]`` -> the routed experts' weighted sum ``[T, hidden]``. The
        ``T k`` (token, expert) pairs are sorted by expert, each expert runs over its rows
        of the sorted copy, and the results go back to pair order to be summed per token."""
        top_k, num_tokens = self.sliding.top_k, h.shape[0]
        logits = F.linear(h, w.router, w.router_bias)  # [T, E]
        top, ids = torch.topk(logits, top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)
        if isinstance(w, GptOssMxfp4Experts):
            assert self.mxfp4 is not None and w.prepared is not None
            return self.mxfp4(h, weights, ids, w.prepared)
        order = torch.argsort(ids.flatten(), stable=True)  # [T k]: pairs by expert
        counts = torch.bincount(ids.flatten(), minlength=self.sliding.num_experts).tolist()
        x = h[order // top_k]  # [T k, hidden], sorted
        y = torch.empty_like(x)
        at = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(at, at + count)
                gate_up = F.linear(x[rows], w.gate_up[expert], w.gate_up_bias[expert])
                hidden = self._clamped_swiglu_(gate_up)
                torch.addmm(w.down_bias[expert], hidden, w.down[expert].t(), out=y[rows])
                at += count
        pairs = torch.empty_like(y)
        pairs[order] = y  # [T k, hidden] in (token, slot) order
        return torch.bmm(weights[:, None, :], pairs.view(num_tokens, top_k, -1))[:, 0]

    def _clamped_swiglu_(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[n, 2I] -> [n, I]``, computed in place in ``gate_up``'s halves."""
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.sliding.swiglu_limit
        gate.clamp_(max=limit)
        glu = gate.mul_(torch.sigmoid(gate * self.sliding.swiglu_alpha))
        return up.clamp_(min=-limit, max=limit).add_(1.0).mul_(glu)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        last = rms_norm(hidden, self.weights.norm, self.spec.rms_norm_eps)
        return F.linear(last, self.weights.lm_head)


def _without_down_bias(weights: GptOssModelWeights) -> GptOssModelWeights:
    """``weights`` with every expert's down bias zero: a rank other than 0 of a TP group,
    whose partial sum must not add the bias a second time."""
    return replace(weights, layers=tuple(_zero_down_bias(layer) for layer in weights.layers))


def _zero_down_bias(layer: GptOssLayerWeights) -> GptOssLayerWeights:
    if not isinstance(layer.experts, GptOssExperts):  # kept MXFP4: TP 1 only
        return layer
    experts = replace(layer.experts, down_bias=torch.zeros_like(layer.experts.down_bias))
    return replace(layer, experts=experts)
