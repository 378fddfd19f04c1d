"""The decoder of the Llama family (Llama, Mistral, Qwen2, Qwen3) over packed tokens.

Weights arrive fused from the loader (q/k/v in one matrix, gate/up in one), so each layer is
four GEMMs over all tokens of the batch. The layer writes its fresh K/V into the pool before
attention, and only the rows that need logits go through the final norm and LM head::

    x = embed(ids)                                   [T, hidden]
    per layer:  qkv = norm(x) @ Wqkv                 [T, (H + 2 KV) D]
                (qwen3: q/k RMSNorm per head), RoPE, write K/V to pages, attention
                x += attn @ Wo ;  x += silu(g) * u @ Wdown,  [g|u] = norm(x) @ Wgu
                (a sparse layer of a MoE family: x += moe.block's routed experts instead)
    logits = norm(x[rows]) @ Wlm                     [R, vocab]

Under tensor parallelism (``model.parallel``) the weights are this rank's slices: the same
code runs over the rank's heads and intermediate range, and the o and down projections sum
their partial products over the ranks (one all-reduce each); at TP 1 none runs.

Prompt logprobs (only when a chunk asks) read the same final hidden states at their own rows
and keep one float per row: ``log_softmax(norm(x[row]) @ Wlm)[next token]``, computed over
blocks of rows so that at most ``[block, vocab]`` logits exist at once, whatever the prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch
import torch.nn.functional as F

from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.gdn import StateSpan
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.layers import Rotary, rms_norm, silu_and_mul_
from prefill_worker.model.moe import ExpertsBackend, create_moe_backend
from prefill_worker.model.moe.block import MoEWeights, moe_mlp
from prefill_worker.model.parallel import SINGLE, TPGroup, row_parallel
from prefill_worker.model.quant.linear import Weight, linear, linear_into
from prefill_worker.model.sharding import local_dims


@dataclass(frozen=True, slots=True, eq=False)
class LayerWeights:
    """One layer's weights; under TP, this rank's slices (H, KV, I: the rank's counts)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [(H + 2 KV) * D, hidden] (FP8 kept: an Fp8BlockWeight, quant.linear)
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) * D]
    o: Weight  # [hidden, H * D]
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    mlp: DenseMLP | MoEWeights  # MoEWeights: a sparse layer of a MoE family


@dataclass(frozen=True, slots=True, eq=False)
class DenseMLP:
    gate_up: Weight  # [2 I, hidden], gate rows first
    gate_up_bias: torch.Tensor | None
    down: Weight  # [hidden, I]
    down_bias: torch.Tensor | None


@dataclass(frozen=True, slots=True, eq=False)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


@dataclass(frozen=True, slots=True, eq=False)
class ForwardInputs:
    """A packed batch as tensors on the model's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its prompt
    slots: torch.Tensor  # [T] int64, flat pool row: page_id * page_size + offset
    logits_rows: torch.Tensor  # [R] int64, rows of the tokens whose logits are wanted
    logprob_rows: torch.Tensor | None = None  # [L] int64, rows scoring the next prompt token
    logprob_token_ids: torch.Tensor | None = None  # [L] int64, the token each of them scores
    state_spans: tuple[StateSpan, ...] = ()  # a hybrid model's chunks and their state slots
    sliding_slots: torch.Tensor | None = None  # [T] int64, rows of a windowed sliding pool

    def slots_of(self, window: int | None) -> torch.Tensor:
        """Where a layer of ``window`` (None: a full layer) writes: a windowed sliding
        pool's rows for a sliding layer, else the pool's."""
        return self.slots if window is None or self.sliding_slots is None else self.sliding_slots


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [R, vocab], of ``logits_rows``
    token_logprobs: torch.Tensor | None  # [L] float32, of ``logprob_rows``; None if none asked


class CausalLM:
    """Forward pass only; owns nothing but its weights and the rotary frequencies.

    Everything but attention runs over blocks of at most ``block_tokens`` rows, updating
    the residual stream in place, and the largest intermediate (``[rows, 2I]``) lives in one
    buffer per forward. On a CPU, fresh tensors over glibc's mmap threshold (32 MiB) cost
    more in page faults than the op itself; blocks bound the other temporaries. The block
    is large because each op is also an OpenMP barrier, which is slow on shared cores.
    A sparse layer's experts run over all ``T`` tokens at once (each expert's weights read
    once per forward; the gather by expert is ``[T k, hidden]``).
    """

    block_tokens = 2048
    logprob_block_bytes = 64 << 20  # the fp32 logits of one block of prompt-logprob rows

    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        tp: TPGroup = SINGLE,
        experts: ExpertsBackend | None = None,
    ) -> None:
        self.spec = spec
        self.tp = tp
        self.dtype = weights.embed.dtype
        self.experts = experts or create_moe_backend("auto", weights.embed.device, self.dtype)
        self.weights = prepared_experts(weights, self.experts)
        self.rotary = Rotary(spec.rope, spec.head_dim, weights.embed.device)
        self.local = local_dims(spec, tp)  # this rank's head and intermediate counts
        self._q_dim = self.local.num_heads * spec.head_dim
        self._kv_dim = self.local.num_kv_heads * spec.head_dim

    def forward(
        self, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> ForwardOutput:
        """Write every token's K/V into its pages; return the logits ``[R, vocab]`` and the
        prompt logprobs ``[L]``."""
        return self.forward_with_states(inputs, kv_cache, attention, ())[0]

    def forward_with_states(
        self,
        inputs: ForwardInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
        layers: tuple[int, ...],
    ) -> tuple[ForwardOutput, list[torch.Tensor]]:
        """``forward``, and the residual stream ``[T, hidden]`` entering each of ``layers``
        (``num_layers``: the final residual, before the norm), copies in that order (an
        EAGLE draft reads them, ``model.draft``)."""
        spec, local, num_tokens = self.spec, self.local, inputs.input_ids.shape[0]
        captured: dict[int, torch.Tensor] = {}
        x = F.embedding(inputs.input_ids, self.weights.embed)  # [T, hidden], the residual
        cos, sin = self.rotary.cos_sin(inputs.positions, self.dtype)  # [T, 1, D/2] each
        # Reused by every layer: [T, heads, D] each.
        q = x.new_empty(num_tokens, local.num_heads, spec.head_dim)
        k = x.new_empty(num_tokens, local.num_kv_heads, spec.head_dim)
        v = torch.empty_like(k)
        attn = torch.empty_like(q)
        gate_up = x.new_empty(min(num_tokens, self.block_tokens), 2 * local.intermediate_size)
        blocks = [
            slice(r, min(r + self.block_tokens, num_tokens))
            for r in range(0, num_tokens, self.block_tokens)
        ]
        for index, layer in enumerate(self.weights.layers):
            if index in layers:
                captured[index] = x.clone()
            for rows in blocks:
                self._qkv(layer, x[rows], cos[rows], sin[rows], q[rows], k[rows], v[rows])
            kv_cache.write(index, inputs.slots, k, v)
            pools = kv_cache.k[index], kv_cache.v[index]
            attention.attend(q, k, v, *pools, attn, kv_cache.layout.scales_of(index))
            if isinstance(layer.mlp, MoEWeights):  # every expert's weights read once
                for rows in blocks:
                    self._output(layer, x[rows], attn[rows])
                self._moe(layer.mlp, layer.post_norm, x)
                continue
            for rows in blocks:
                self._output_and_mlp(layer, x[rows], attn[rows], gate_up)
        captured[len(self.weights.layers)] = x
        block = max(1, self.logprob_block_bytes // (4 * self.spec.vocab_size))
        return forward_output(x, inputs, self._logits, block), [captured[i] for i in layers]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [R, hidden]`` (final residual rows) -> logits ``[R, vocab]``."""
        last = rms_norm(hidden, self.weights.norm, self.spec.rms_norm_eps)
        return F.linear(last, self.weights.lm_head)

    def _qkv(
        self,
        layer: LayerWeights,
        x: torch.Tensor,  # [B, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_out: torch.Tensor,  # [B, H, D]
        k_out: torch.Tensor,  # [B, KV, D]
        v_out: torch.Tensor,
    ) -> None:
        eps = self.spec.rms_norm_eps
        qkv = linear(rms_norm(x, layer.input_norm, eps), layer.qkv, layer.qkv_bias)
        q = qkv[:, : self._q_dim].view(q_out.shape)
        k = qkv[:, self._q_dim : self._q_dim + self._kv_dim].view(k_out.shape)
        v_out.copy_(qkv[:, self._q_dim + self._kv_dim :].view(v_out.shape))
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(q, layer.q_norm, eps)
            k = rms_norm(k, layer.k_norm, eps)
        self.rotary.apply_into(q, cos, sin, q_out)
        self.rotary.apply_into(k, cos, sin, k_out)

    def _output(self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> None:
        """``x [B, hidden]`` += o-projection of ``attn [B, H, D]``."""
        x.add_(row_parallel(attn.reshape(x.shape[0], self._q_dim), layer.o, layer.o_bias, self.tp))

    def _moe(self, mlp: MoEWeights, post_norm: torch.Tensor, x: torch.Tensor) -> None:
        """``x [T, hidden]`` += a sparse layer's MLP, over all the forward's tokens at once."""
        assert self.spec.moe is not None  # the loader builds MoEWeights only then
        h = rms_norm(x, post_norm, self.spec.rms_norm_eps)
        x.add_(moe_mlp(h, mlp, self.spec.moe, self.experts, self.tp))

    def _output_and_mlp(
        self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        """``x [B, hidden]`` += o-projection of ``attn [B, H, D]``, then += the dense MLP."""
        self._output(layer, x, attn)
        h = rms_norm(x, layer.post_norm, self.spec.rms_norm_eps)
        mlp = layer.mlp
        assert isinstance(mlp, DenseMLP)
        gate_up = buffer[: x.shape[0]]  # [B, 2I]
        linear_into(h, mlp.gate_up, mlp.gate_up_bias, gate_up)
        x.add_(row_parallel(silu_and_mul_(gate_up), mlp.down, mlp.down_bias, self.tp))


def forward_output(
    x: torch.Tensor,
    inputs: ForwardInputs,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    block: int,
) -> ForwardOutput:
    """From the final residual ``x [T, hidden]``: the logits of ``inputs.logits_rows`` and,
    when asked, the prompt logprobs (``token_logprobs``, ``block`` rows of logits at once)."""
    logprobs = None
    if inputs.logprob_rows is not None and inputs.logprob_token_ids is not None:
        rows, token_ids = inputs.logprob_rows, inputs.logprob_token_ids
        logprobs = token_logprobs(logits_of, x, rows, token_ids, block)
    return ForwardOutput(logits_of(x[inputs.logits_rows]), logprobs)


def token_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """``log_softmax(logits_of(x[rows]))[token_ids]``: ``[L]`` float32, over blocks of
    ``block`` rows so that at most ``[block, vocab]`` logits exist at once."""
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)  # [L]
    for r in range(0, rows.shape[0], block):
        logits = logits_of(x[rows[r : r + block]]).float()  # [B, vocab]
        picked = logits.gather(1, token_ids[r : r + block, None])[:, 0]  # [B]
        out[r : r + block] = picked - torch.logsumexp(logits, dim=-1)
    return out


class _Layered(Protocol):
    """A frozen dataclass of per-layer weights (what ``dataclasses.replace`` takes)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def layers(self) -> tuple[Any, ...]: ...


_W = TypeVar("_W", bound=_Layered)


def prepared_experts(weights: _W, experts: ExpertsBackend) -> _W:
    """``weights`` (a model's weight record: this family's or another's whose layers carry
    an ``mlp``) with every sparse layer's experts in ``experts``' layout."""
    layers = tuple(
        dataclasses.replace(layer, mlp=experts.prepare(layer.mlp))
        if isinstance(layer.mlp, MoEWeights)
        else layer
        for layer in weights.layers
    )
    return dataclasses.replace(weights, layers=layers)
