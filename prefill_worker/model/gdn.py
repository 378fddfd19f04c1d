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

The delta rule is the chunked form (``packed_gated_delta_rule``: 64-token blocks, a
triangular solve inside each, a sequential scan across them), transformers' torch path in
fp32, run for every chunk of the batch at once: the blocks of all of them in one tensor, so
the intra-block work is one set of batched ops and the scan takes as many steps as the
longest chunk has blocks (each step over the chunks still running), where one chunk at a
time took a step per block of every chunk. The triangular solves are one product with the
block's inverse (``_unit_lower_inverse``: batched GEMMs, where torch's batched solve ran a
LAPACK call per block). transformers' arithmetic per block, rounded differently (full size,
fp32: within 6e-8 of it).
``TorchDeltaRule`` runs it; ``gdn_rule`` chooses it or flashinfer's prefill kernel
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
    """Every span at once through ``packed_gated_delta_rule``, each from its slot's state."""

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
        slots, states = initial_states(recurrent_state, spans)
        bounds = [(span.q_start, span.q_end) for span in spans]
        core = packed_gated_delta_rule(q, k, v, g, beta, bounds, states).to(v.dtype)
        recurrent_state[slots] = states
        return core


TORCH_RULE = TorchDeltaRule()


def initial_states(
    recurrent_state: torch.Tensor, spans: tuple[StateSpan, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spans' slots and a copy of their recurrent states ``[B, Hv, Dk, Dv]``, one per span
    (the slots differ), zero for a prompt's first chunk (its slot held an earlier request's):
    where each delta rule starts."""
    slots = torch.tensor([span.slot for span in spans], device=recurrent_state.device)
    states = recurrent_state[slots]
    for i, span in enumerate(spans):
        if span.is_first:
            states[i].zero_()
    return slots, states


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


def _diagonal_blocks(a: torch.Tensor, size: int) -> torch.Tensor:
    """``a [..., n, n]`` -> its diagonal ``size``-square blocks ``[..., n / size, size, size]``."""
    m = a.shape[-1] // size
    blocks = a.reshape(*a.shape[:-2], m, size, m, size).diagonal(dim1=-4, dim2=-2)
    return blocks.permute(*range(a.dim() - 2), -1, -3, -2)  # [..., m, size, size]


def _unit_lower_inverse(a: torch.Tensor, leaf: int = 16) -> torch.Tensor:
    """The inverse of ``a [..., n, n]``, unit lower triangular (its strict upper part and
    diagonal are not read; ``n`` a power of two times ``leaf``), by blocks: the diagonal
    ``leaf`` blocks by forward substitution, then pairs merged up to ``n`` with
    ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``. Batched GEMMs only, where
    a batched ``solve_triangular`` runs one small LAPACK solve per matrix (its CPU time was
    most of the rule's)."""
    n = a.shape[-1]
    size = min(leaf, n)
    diag = _diagonal_blocks(a, size)  # [..., m, s, s]
    inv = torch.zeros_like(diag)
    inv[..., 0, 0] = 1.0
    for i in range(1, size):  # row i of the inverse from the rows above it
        inv[..., i, :i] = -(diag[..., i : i + 1, :i] @ inv[..., :i, :i])[..., 0, :]
        inv[..., i, i] = 1.0
    while size < n:
        pairs = _diagonal_blocks(a, 2 * size)  # [..., m / 2, 2s, 2s]
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        merged = torch.zeros_like(pairs)
        merged[..., :size, :size] = first
        merged[..., size:, size:] = second
        merged[..., size:, :size] = -((second @ pairs[..., size:, :size]) @ first)
        inv, size = merged, 2 * size
    return inv[..., 0, :, :]


def packed_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk], the sequences packed
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    bounds: list[tuple[int, int]],  # each sequence's rows [start, end)
    states: torch.Tensor,  # [B, Hv, Dk, Dv] fp32, one per sequence: read as S0, left final
) -> torch.Tensor:
    """The gated delta rule over several sequences at once: ``[T, Hv, Dv]`` fp32 outputs.

    Each sequence is cut into ``CHUNK``-token blocks (its last one zero-padded, as
    transformers pads); the blocks of every sequence are laid out step by step (the first
    block of each, then the second of those that have one, ...; the longest sequences
    first), so the intra-block work runs once over all blocks and the scan across blocks
    takes one step per block of the longest sequence, each step over the sequences still
    running (a prefix of the states)."""
    num_tokens, num_v_heads = v.shape[0], v.shape[1]
    rep = num_v_heads // q.shape[1]
    blocks = [-(-(end - start) // CHUNK) for start, end in bounds]
    order = sorted(range(len(bounds)), key=lambda i: -blocks[i])  # stable: longest first
    active = [sum(1 for i in order if blocks[i] > step) for step in range(max(blocks, default=0))]
    # src[j]: the token at padded position j of the block layout (num_tokens: a zero row)
    src: list[int] = []
    for step, count in enumerate(active):
        for i in order[:count]:
            first = bounds[i][0] + step * CHUNK
            rows = range(first, min(first + CHUNK, bounds[i][1]))
            src.extend(rows)
            src.extend([num_tokens] * (CHUNK - len(rows)))
    index = torch.tensor(src, dtype=torch.long, device=q.device)
    num_blocks = len(src) // CHUNK

    def blocked(t: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [N, Hv, CHUNK, ...]
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])[index]
        return padded.view(num_blocks, CHUNK, *t.shape[1:]).transpose(1, 2)

    qf = l2norm(q.float()) * q.shape[-1] ** -0.5
    kf = l2norm(k.float())
    qb, kb = (blocked(t).repeat_interleave(rep, dim=1) for t in (qf, kf))  # [N, Hv, C, Dk]
    vb = blocked(v.float())  # [N, Hv, C, Dv]
    beta_b, decay = blocked(beta.float()), blocked(g.float())  # [N, Hv, C]
    k_beta = kb * beta_b[..., None]
    cum = decay.cumsum(dim=-1)  # [N, Hv, C]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ kb.transpose(-1, -2)) * pairwise  # unit lower triangular after the solve
    intra = (qb @ kb.transpose(-1, -2)) * pairwise
    dv = vb.shape[-1]
    rhs = torch.cat([vb * beta_b[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    solved = _unit_lower_inverse(system) @ rhs
    new_v, k_cum = solved[..., :dv], solved[..., dv:]
    qb = qb * cum.exp()[..., None]
    kb_t = (kb * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # [N, Hv, Dk, C]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, Hv, 1, 1]
    out = torch.empty_like(new_v)  # [N, Hv, C, Dv]
    s = states[order] if order != list(range(len(order))) else states.clone()
    lo = 0
    for count in active:
        hi, live = lo + count, s[:count]
        v_new = new_v[lo:hi] - k_cum[lo:hi] @ live
        out[lo:hi] = qb[lo:hi] @ live + intra[lo:hi] @ v_new
        s[:count] = live * chunk_decay[lo:hi] + kb_t[lo:hi] @ v_new
        lo = hi
    states[order] = s
    # back to token order: position of each token in the block layout
    where = torch.zeros(num_tokens + 1, dtype=torch.long, device=q.device)
    where[index] = torch.arange(len(src), device=q.device)
    return out.transpose(1, 2).reshape(-1, num_v_heads, dv)[where[:num_tokens]]
