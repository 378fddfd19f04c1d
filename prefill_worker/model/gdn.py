"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5, over packed tokens.

Per layer, for all ``T`` tokens of the batch at once::

    [qkv | z | b | a] = h @ Win                     [T, conv_dim + Vd + 2 Hv]
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)         [T, Hv] fp32

then per chunk of the batch (each its own request's state slot)::

    qkv = silu(causal depthwise conv(conv_state ++ qkv))   conv_state: the last K-1 inputs
    o, S = gated delta rule(l2norm(q), l2norm(k), v, g, beta; S0)   S: [Hv, Dk, Dv] fp32

and for all tokens again ``out = (rmsnorm(o) * silu(z)) @ Wout``. A chunk that starts its
prompt begins from zero state; a later chunk from what its slot holds, and every chunk leaves
its slot holding the state after its last token (state carried from chunk to chunk).

The delta rule is the chunked form (``chunk_gated_delta_rule``: 64-token blocks, a
triangular solve inside each, a sequential scan across them), transformers' torch path in
fp32 (``TorchDeltaRule``); ``gdn_rule`` chooses it or flashinfer's prefill kernel
(``DeltaRule``: the whole batch in one call, the states converted to and from its layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.model.parallel import SINGLE, TPGroup, row_parallel

CHUNK = 64  # the delta rule's block of tokens


@dataclass(frozen=True, slots=True, eq=False)
class GDNWeights:
    in_proj: torch.Tensor  # [conv_dim + Vd + 2 Hv, hidden]: q, k, v | z | b | a
    conv: torch.Tensor  # [conv_dim, K]
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [Dv], the gated RMSNorm's weight
    out: torch.Tensor  # [hidden, Vd]


@dataclass(frozen=True, slots=True)
class StateSpan:
    """One chunk of the packed batch: rows ``[q_start, q_end)``, its request's state slot,
    whether it starts the prompt (zero state) or continues it (the slot's state), and
    whether it ends the prompt (its slot then holds the state a decode gets)."""

    q_start: int
    q_end: int
    slot: int
    is_first: bool
    is_last: bool = False


class DeltaRule(Protocol):
    """How a layer's delta rule runs over the packed batch (``gdn_rule``'s registry: the
    torch path here, flashinfer's prefill kernel on a GPU that has it)."""

    name: str

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hk, Dk], after the conv, not normalized
        k: torch.Tensor,  # [T, Hk, Dk]
        v: torch.Tensor,  # [T, Hv, Dv]
        g: torch.Tensor,  # [T, Hv] fp32, log decay
        beta: torch.Tensor,  # [T, Hv]
        spans: tuple[StateSpan, ...],
        recurrent_state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32, each span's slot updated
    ) -> torch.Tensor:  # [T, Hv, Dv]
        ...


class TorchDeltaRule:
    """Each span through ``chunk_gated_delta_rule`` in turn, from its slot's state."""

    name = "torch"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        spans: tuple[StateSpan, ...],
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        core = v.new_empty(v.shape)
        for span in spans:
            rows = slice(span.q_start, span.q_end)
            state = recurrent_state[span.slot]
            if span.is_first:
                state.zero_()
            out = chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
            core[rows] = out.to(v.dtype)
        return core


TORCH_RULE = TorchDeltaRule()


def gated_delta_net(
    h: torch.Tensor,  # [T, hidden], the normed residual
    w: GDNWeights,
    spec: LinearAttentionSpec,
    eps: float,
    spans: tuple[StateSpan, ...],
    conv_state: torch.Tensor,  # [S, conv_dim, K - 1], this layer's slots
    recurrent_state: torch.Tensor,  # [S, Hv, Dk, Dv] fp32
    tp: TPGroup = SINGLE,
    rule: DeltaRule = TORCH_RULE,
) -> torch.Tensor:
    """The layer's output ``[T, hidden]``; each span's slots updated in place. Under tensor
    parallelism ``spec`` and ``w`` are the rank's heads (``sharding.local_linear``): every
    step but the out projection is per head, and that one is row-parallel (one all-reduce)."""
    num_tokens, hv, dv = h.shape[0], spec.num_v_heads, spec.head_v_dim
    mixed, z, b, a = F.linear(h, w.in_proj).split([spec.conv_dim, spec.value_dim, hv, hv], -1)
    beta = b.sigmoid()  # [T, Hv]
    g = -w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias)  # [T, Hv] fp32
    x = torch.empty_like(mixed)
    for span in spans:
        rows = slice(span.q_start, span.q_end)
        x[rows] = causal_conv(mixed[rows], w.conv, conv_state[span.slot], span.is_first)
    q, k, v = x.split([spec.key_dim, spec.key_dim, spec.value_dim], -1)
    heads_k, dim_k = spec.num_k_heads, spec.head_k_dim
    core = rule(
        q.reshape(num_tokens, heads_k, dim_k),
        k.reshape(num_tokens, heads_k, dim_k),
        v.reshape(num_tokens, hv, dv),
        g,
        beta,
        spans,
        recurrent_state,
    )
    normed = gated_rms_norm(core.to(h.dtype), z.reshape(num_tokens, hv, dv), w.norm, eps)
    return row_parallel(normed.reshape(num_tokens, spec.value_dim), w.out, None, tp)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, is_first: bool
) -> torch.Tensor:
    """``x [n, C]`` (one chunk's pre-conv channels) -> ``silu(conv) [n, C]``; ``state [C,
    K-1]`` (the inputs before ``x``; zeros when ``is_first``) becomes the last K-1 inputs."""
    if is_first:
        state.zero_()
    window = torch.cat([state, x.t().to(weight.dtype)], dim=1)  # [C, K-1+n]
    out = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
    state.copy_(window[:, -state.shape[1] :])
    return F.silu(out).t().to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dimension, in transformers' order."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [n, Hk, Dk]
    k: torch.Tensor,  # [n, Hk, Dk]
    v: torch.Tensor,  # [n, Hv, Dv]
    g: torch.Tensor,  # [n, Hv] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [n, Hv]
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32: read as S0, left as the final state
) -> torch.Tensor:
    """The gated delta rule over one sequence: ``[n, Hv, Dv]`` fp32 outputs."""
    n, num_v_heads = v.shape[0], v.shape[1]
    rep = num_v_heads // q.shape[1]
    q = l2norm(q.float()).repeat_interleave(rep, dim=1)  # [n, Hv, Dk]
    k = l2norm(k.float()).repeat_interleave(rep, dim=1)
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - n % CHUNK) % CHUNK
    # [Hv, C, CHUNK, D] each; decay and beta [Hv, C, CHUNK]
    q, k, v = (F.pad(t.transpose(0, 1).float(), (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = (F.pad(t.t().float(), (0, pad)) for t in (beta, g))
    q, k, v = (t.reshape(num_v_heads, -1, CHUNK, t.shape[-1]) for t in (q, k, v))
    beta, decay = beta.reshape(num_v_heads, -1, CHUNK), decay.reshape(num_v_heads, -1, CHUNK)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = decay.cumsum(dim=-1)  # [Hv, C, CHUNK]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower triangular after the solve
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, C, 1, 1]
    out = torch.empty_like(new_v)  # [Hv, C, CHUNK, Dv]
    s = state
    for i in range(q.shape[1]):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(num_v_heads, -1, v.shape[-1])[:, :n].transpose(0, 1)
