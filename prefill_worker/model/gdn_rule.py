"""Which delta rule a Gated DeltaNet layer runs (``gdn.DeltaRule``): ``torch`` (the chunked
form in fp32, any device) or ``flashinfer`` (flashinfer 0.6.13's GDN prefill kernel,
``flashinfer.gdn_prefill.chunk_gated_delta_rule``), and the conversions between our state
slot and that kernel's state.

The kernel takes the whole batch in one call (``cu_seqlens``), one initial state per span
and returns one final state per span. Its contract differs from ours in three places, each
converted here:

    state     ours ``[Hv, Dk, Dv]`` (what the transfer sends); the kernel's ``[Hv, Dv, Dk]``
              (k last): ``to_kernel_state`` / ``from_kernel_state`` transpose the last two
    gate      ours ``g`` the log decay; the kernel's the decay itself, ``exp(g)``
    q, k      it does not normalize them: l2-normalized here (as the torch path does)

A span that starts its prompt starts from zeros; a later chunk from its slot; every span's
final state goes back into its slot (the state carried from chunk to chunk is ours, so a
pull or push reads the same bytes whichever rule ran).

The kernel exists for SM90 (a JIT-built CUTLASS kernel, 64x64x128 tiles) and SM100/SM103
(CuTe DSL; CUDA 13+), half-precision q/k/v, one head size of 128 for q, k and v (Qwen3-Next's
and Qwen3.5's).
``linear_rule_choice`` is the one place that decides; anything else runs the torch path,
with the reason logged and in ``ModelInfo.kernel_paths``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from prefill_worker.model.gdn import TORCH_RULE, DeltaRule, StateSpan, initial_states, l2norm
from prefill_worker.model.hf_linear import LinearAttentionSpec

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


def to_kernel_state(state: torch.Tensor) -> torch.Tensor:
    """Our ``[..., Hv, Dk, Dv]`` state as the kernel's ``[..., Hv, Dv, Dk]`` (a copy)."""
    return state.transpose(-1, -2).contiguous()


def from_kernel_state(state: torch.Tensor) -> torch.Tensor:
    """The kernel's ``[..., Hv, Dv, Dk]`` as our ``[..., Hv, Dk, Dv]`` (a view)."""
    return state.transpose(-1, -2)


def linear_rule_choice(
    attention_backend: str,
    device: torch.device,
    dtype: torch.dtype,
    spec: LinearAttentionSpec,
    capability: tuple[int, int] | None,
    cuda_version: str | None,
    installed: bool,
) -> tuple[str, str]:
    """``(name, why)``: ``flashinfer`` where its kernel applies (the attention backend is
    flashinfer, CUDA, a supported arch, half precision, Dk == Dv == 128), else ``torch`` and
    why."""
    if attention_backend != "flashinfer" or device.type != "cuda":
        return "torch", f"attention backend {attention_backend} on {device.type}"
    if not installed:
        return "torch", "flashinfer is not installed"
    if dtype not in HALF:
        return "torch", f"the kernel takes bf16/fp16, not {str(dtype).removeprefix('torch.')}"
    if (spec.head_k_dim, spec.head_v_dim) != (128, 128):
        dims = f"Dk {spec.head_k_dim}, Dv {spec.head_v_dim}"
        return "torch", f"the kernel takes head size 128 for q, k and v, not {dims}"
    major = capability[0] if capability is not None else 0
    if major == 9:
        return "flashinfer", "SM90"
    if major == 10:
        cuda_major = int(cuda_version.split(".")[0]) if cuda_version else 0
        if cuda_major < 13:
            return "torch", "its SM100 kernel needs CUDA 13+"
        return "flashinfer", "SM100"
    sm = "unknown" if capability is None else f"SM{capability[0]}{capability[1]}"
    return "torch", f"no GDN prefill kernel for {sm} (SM90 and SM100 only)"


def choose_delta_rule(
    attention_backend: str, device: torch.device, dtype: torch.dtype, spec: LinearAttentionSpec
) -> tuple[DeltaRule, str]:
    """The layer's ``DeltaRule`` on this host, and the line that says which and why."""
    cuda = device.type == "cuda"
    name, why = linear_rule_choice(
        attention_backend,
        device,
        dtype,
        spec,
        torch.cuda.get_device_capability(device) if cuda else None,
        torch.version.cuda,
        cuda and importlib.util.find_spec("flashinfer") is not None,
    )
    rule: DeltaRule = TORCH_RULE
    if name == "flashinfer":
        rule, why = probed(FlashInferDeltaRule, spec, device, dtype, why)
        name = rule.name
    line = f"gdn={name} ({why})"
    if name == "torch" and cuda:
        log.warning("Gated DeltaNet: the torch delta rule on CUDA: %s", why)
    else:
        log.info("Gated DeltaNet: the %s delta rule (%s)", name, why)
    return rule, line


def probed(
    make: Callable[[], DeltaRule],
    spec: LinearAttentionSpec,
    device: torch.device,
    dtype: torch.dtype,
    why: str,
) -> tuple[DeltaRule, str]:
    """``make()``'s rule once it ran a start-up probe (65 tokens over one head group: the
    import, a JIT build, a launch), or the torch rule and why it did not."""
    hk, rep, dk, dv = 1, spec.num_v_heads // spec.num_k_heads, spec.head_k_dim, spec.head_v_dim
    try:
        rule = make()
        gen = torch.Generator(device=device).manual_seed(0)
        q, k = (torch.randn(65, hk, dk, generator=gen, device=device, dtype=dtype) for _ in "qk")
        v = torch.randn(65, rep, dv, generator=gen, device=device, dtype=dtype)
        g, beta = -torch.rand(65, rep, device=device), torch.rand(65, rep, device=device)
        state = torch.zeros(1, rep, dk, dv, device=device)
        out = rule(q, k, v, g, beta.to(dtype), (StateSpan(0, 65, 0, True),), state)
        if not bool(out.float().isfinite().all()):
            raise RuntimeError("non-finite output")
    except Exception as exc:
        return TORCH_RULE, f"the kernel failed its start-up probe: {exc!r}"[:300]
    return rule, why


class FlashInferDeltaRule:
    """The batch's spans in one call of flashinfer's GDN prefill. ``kernel`` is
    ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` unless given (a unit seam)."""

    name = "flashinfer"

    def __init__(self, kernel: Callable[..., Any] | None = None) -> None:
        if kernel is None:
            from flashinfer.gdn_prefill import chunk_gated_delta_rule  # CUDA only

            kernel = chunk_gated_delta_rule
        self._kernel = kernel

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
        bounds = [0] + [span.q_end for span in spans]
        starts = [span.q_start for span in spans]
        assert starts == bounds[:-1] and bounds[-1] == q.shape[0], "spans must tile the batch"
        cu_seqlens = torch.tensor(bounds, dtype=torch.int64, device=q.device)
        slots, states = initial_states(recurrent_state, spans)
        initial = to_kernel_state(states)  # [N, Hv, Dv, Dk]
        out, final = self._kernel(
            l2norm(q.float()).to(v.dtype).contiguous(),
            l2norm(k.float()).to(v.dtype).contiguous(),
            v.contiguous(),
            g=g.float().exp().contiguous(),
            beta=beta.float().contiguous(),
            scale=q.shape[-1] ** -0.5,
            initial_state=initial,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
        )
        recurrent_state[slots] = from_kernel_state(final).to(recurrent_state.dtype)
        return out
