"""The Gated DeltaNet delta rule's backend choice and the flashinfer path's host side, on the
CPU: which rule a host gets and why, the state converted to the kernel's layout and back, and
``FlashInferDeltaRule`` driving a stand-in of flashinfer 0.6.13's GDN prefill (its signature,
its checks, its token-by-token definition) against the torch path: same outputs, same states
left in the slots. The kernel itself is proven on a GPU (``tests/gpu/test_gdn_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.model.gdn import TORCH_RULE, StateSpan
from prefill_worker.model.gdn_rule import (
    FlashInferDeltaRule,
    choose_delta_rule,
    from_kernel_state,
    linear_rule_choice,
    probed,
    to_kernel_state,
)
from prefill_worker.model.hf_linear import LinearAttentionSpec
from tests.unit.model.flashinfer_stand_ins import gdn_prefill

CUDA, CPU, BF16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16


def _spec(dk: int = 128, dv: int = 128) -> LinearAttentionSpec:
    return LinearAttentionSpec(
        layer_kinds=("linear_attention", "full_attention"), num_k_heads=2, num_v_heads=4,
        head_k_dim=dk, head_v_dim=dv, conv_kernel=4, rotary_dim=16, qkvz_grouped=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "spec", "cap", "cuda", "installed", "want"),
    [
        ("flashinfer", CUDA, BF16, _spec(), (9, 0), "12.8", True, ("flashinfer", "SM90")),
        ("flashinfer", CUDA, BF16, _spec(), (10, 0), "13.0", True, ("flashinfer", "SM100")),
        ("flashinfer", CUDA, BF16, _spec(), (10, 0), "12.8", True, ("torch", "CUDA 13")),
        ("flashinfer", CUDA, BF16, _spec(64, 64), (10, 0), "13.0", True, ("torch", "Dk 64, Dv 64")),
        ("flashinfer", CUDA, BF16, _spec(), (8, 0), "12.8", True, ("torch", "SM80")),
        ("flashinfer", CUDA, BF16, _spec(), (12, 0), "12.8", True, ("torch", "SM120")),
        ("flashinfer", CUDA, torch.float32, _spec(), (9, 0), "12.8", True, ("torch", "float32")),
        ("flashinfer", CUDA, BF16, _spec(128, 64), (9, 0), "12.8", True, ("torch", "Dv 64")),
        ("flashinfer", CUDA, BF16, _spec(), (9, 0), "12.8", False, ("torch", "not installed")),
        ("sdpa", CUDA, BF16, _spec(), (9, 0), "12.8", True, ("torch", "sdpa on cuda")),
        ("sdpa", CPU, BF16, _spec(), None, None, False, ("torch", "sdpa on cpu")),
    ],
)
def test_the_kernel_is_chosen_only_where_it_applies(
    backend, device, dtype, spec, cap, cuda, installed, want
):
    name, why = linear_rule_choice(backend, device, dtype, spec, cap, cuda, installed)
    assert name == want[0] and want[1] in why, (name, why)


def test_a_cpu_host_gets_the_torch_rule_and_says_why():
    rule, line = choose_delta_rule("sdpa", CPU, torch.float32, _spec())
    assert rule is TORCH_RULE and line == "gdn=torch (attention backend sdpa on cpu)"


def test_state_round_trips_through_the_kernel_layout():
    state = torch.randn(3, 4, 12, 10)  # [S, Hv, Dk, Dv]
    kernel = to_kernel_state(state)
    assert kernel.shape == (3, 4, 10, 12) and kernel.is_contiguous()
    assert torch.equal(kernel[1, 2, 7, 5], state[1, 2, 5, 7])
    assert torch.equal(from_kernel_state(kernel), state)


def _inputs(num_tokens: int, hk: int = 2, hv: int = 4, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, hk, d, generator=gen).to(BF16)
    k = torch.randn(num_tokens, hk, d, generator=gen).to(BF16)
    v = torch.randn(num_tokens, hv, d, generator=gen).to(BF16)
    g = -torch.rand(num_tokens, hv, generator=gen) * 0.5  # log decay
    beta = torch.rand(num_tokens, hv, generator=gen).to(BF16)
    return q, k, v, g, beta


def test_flashinfer_rule_matches_the_torch_rule_through_the_stand_in():
    """Three spans: a fresh prompt (its slot holds junk the rule must ignore), a later chunk
    from its slot's state, and a fresh prompt past one 64-token block; an unused slot stays
    as it was. Outputs and every slot's state agree with the torch path's."""
    q, k, v, g, beta = _inputs(150)
    spans = (StateSpan(0, 40, 2, True), StateSpan(40, 47, 0, False), StateSpan(47, 150, 3, True))
    gen = torch.Generator().manual_seed(1)
    slots = torch.randn(5, 4, 16, 16, generator=gen) * 0.3  # [S, Hv, Dk, Dv] fp32
    want_state, got_state = slots.clone(), slots.clone()
    want = TORCH_RULE(q, k, v, g, beta, spans, want_state)
    got = FlashInferDeltaRule(gdn_prefill)(q, k, v, g, beta, spans, got_state)
    assert got.shape == want.shape == (150, 4, 16)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 0.03, err
    assert torch.allclose(got_state, want_state, rtol=0.03, atol=0.03)
    assert torch.equal(got_state[[1, 4]], slots[[1, 4]])
    assert not torch.allclose(got_state[0], slots[0])  # the continued slot moved on


def test_flashinfer_rule_refuses_spans_that_do_not_tile_the_batch():
    q, k, v, g, beta = _inputs(10)
    slots = torch.zeros(2, 4, 16, 16)
    with pytest.raises(AssertionError, match="tile"):
        FlashInferDeltaRule(gdn_prefill)(q, k, v, g, beta, (StateSpan(2, 10, 0, True),), slots)


def test_a_kernel_that_fails_its_start_up_probe_leaves_the_torch_rule():
    """A kernel that cannot build or launch here (a JIT without a compiler, say) is found at
    start, not at the first request: the torch rule, and why."""

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("nvcc not found")

    rule, why = probed(lambda: FlashInferDeltaRule(broken), _spec(16, 16), CPU, BF16, "SM90")
    assert rule is TORCH_RULE and "start-up probe" in why and "nvcc not found" in why
    rule, why = probed(lambda: FlashInferDeltaRule(gdn_prefill), _spec(16, 16), CPU, BF16, "SM90")
    assert rule.name == "flashinfer" and why == "SM90"
