"""``packed_gated_delta_rule`` runs several sequences at once (their 64-token blocks laid out
step by step, the longest first); each sequence's outputs and final state must be what the
rule gives it alone, from its own initial state, whatever the others' lengths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefill_worker.model.gdn import CHUNK, packed_gated_delta_rule


def _inputs(n: int, hk: int, hv: int, d: int, gen: torch.Generator):  # type: ignore[no-untyped-def]
    q, k = (torch.randn(n, hk, d, generator=gen) for _ in range(2))
    v = torch.randn(n, hv, d + 2, generator=gen)
    g = -F.softplus(torch.randn(n, hv, generator=gen))
    return q, k, v, g, torch.rand(n, hv, generator=gen)


def test_packed_sequences_equal_each_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    hk, hv, d = 2, 4, 6
    lengths = (5, 2 * CHUNK + 3, CHUNK, 1, CHUNK + 1)  # shorter, longer, exact, one token
    q, k, v, g, beta = _inputs(sum(lengths), hk, hv, d, gen)
    initial = torch.randn(len(lengths), hv, d, d + 2, generator=gen)
    bounds, at = [], 0
    for n in lengths:
        bounds.append((at, at + n))
        at += n
    states = initial.clone()
    packed = packed_gated_delta_rule(q, k, v, g, beta, bounds, states)
    for i, (lo, hi) in enumerate(bounds):
        alone = initial[i : i + 1].clone()
        out = packed_gated_delta_rule(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], [(0, hi - lo)], alone
        )
        torch.testing.assert_close(packed[lo:hi], out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[i], alone[0], atol=1e-5, rtol=1e-5)
        assert not torch.equal(states[i], initial[i])  # the state moved


def test_one_token_steps_equal_the_recurrent_rule() -> None:
    """The chunked form against the token-by-token recurrence it computes (transformers'
    ``torch_recurrent_gated_delta_rule``, written out), from a nonzero state."""
    gen = torch.Generator().manual_seed(1)
    n, hk, hv, d = CHUNK + 7, 1, 2, 4
    q, k, v, g, beta = _inputs(n, hk, hv, d, gen)
    s0 = torch.randn(1, hv, d, d + 2, generator=gen)
    states = s0.clone()
    out = packed_gated_delta_rule(q, k, v, g, beta, [(0, n)], states)
    qn = F.normalize(q, dim=-1, eps=1e-3).repeat_interleave(hv // hk, 1) * d**-0.5
    kn = F.normalize(k, dim=-1, eps=1e-3).repeat_interleave(hv // hk, 1)
    s, expected = s0[0].clone(), []
    for t in range(n):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, kn[t])) * beta[t][:, None]
        s = s + kn[t][:, :, None] * delta[:, None, :]
        expected.append(torch.einsum("hkv,hk->hv", s, qn[t]))
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0], s, atol=1e-4, rtol=1e-4)
