"""The state pool's tensors: one slot per request of every linear-attention layer's state.

One allocation per tensor kind, layer-major, slots contiguous; a conv slot is the
``causal_conv1d`` kernels' initial state (``[dim, width - 1]``, channel-major). Whether a
decode's pool matches this byte for byte (SGLang's ``MambaPool``, vLLM's ``DS`` conv layout) is
for the transfer that carries it to check, when one does::

    conv       [num_linear_layers, num_slots, conv_dim, conv_kernel - 1]      model dtype
    recurrent  [num_linear_layers, num_slots, num_v_heads, head_k_dim, head_v_dim]  fp32

Slot s of linear layer l starts at ``base[l] + s * item_bytes``. ``conv`` holds the last
``kernel - 1`` inputs of the causal conv (q, k, v channels before the conv), ``recurrent``
the gated delta rule's state matrix per value head after the last token written. A request's
slot is its aux row (the scheduler holds both from admission to finish); a chunk that starts a
prompt begins from zeros, whatever its slot held before.
"""

from __future__ import annotations

import torch

from prefill_worker.kv.state_layout import LINEAR_STATE, StateComponent, StateRegions, StateTensor
from prefill_worker.model.hf_linear import LinearAttentionSpec

RECURRENT_DTYPE = torch.float32  # the delta rule's state is kept in fp32 (as FLA's kernels)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class StateCache:
    """Owns the state slots of every linear layer; the model reads and writes them."""

    def __init__(
        self, spec: LinearAttentionSpec, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, not {num_slots}")
        self.spec, self.num_slots, self.device = spec, num_slots, device
        num_layers = len(spec.linear_layers)
        self._conv = torch.zeros(  # [L, S, conv_dim, K - 1]
            (num_layers, num_slots, spec.conv_dim, spec.conv_kernel - 1), dtype=dtype, device=device
        )
        self._recurrent = torch.zeros(  # [L, S, Hv, Dk, Dv]
            (num_layers, num_slots, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim),
            dtype=RECURRENT_DTYPE,
            device=device,
        )
        self.conv: tuple[torch.Tensor, ...] = tuple(self._conv)  # each [S, conv_dim, K - 1]
        self.recurrent: tuple[torch.Tensor, ...] = tuple(self._recurrent)  # each [S, Hv, Dk, Dv]

    @property
    def stacked_conv(self) -> torch.Tensor:
        """Every layer's conv slots, ``[L, S, conv_dim, K - 1]``."""
        return self._conv

    @property
    def stacked_recurrent(self) -> torch.Tensor:
        """Every layer's recurrent slots, ``[L, S, Hv, Dk, Dv]`` fp32."""
        return self._recurrent

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._conv, self._recurrent))

    def base_addrs(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per linear layer: the conv tensor's and the recurrent tensor's first byte."""
        return tuple(t.data_ptr() for t in self.conv), tuple(t.data_ptr() for t in self.recurrent)

    def component(self) -> StateComponent:
        """What a decode needs from this pool: every linear layer's slot, sent whole with
        the last chunk."""
        return linear_component(self.spec, self.num_slots, self._conv.dtype)

    def regions(self, device: str) -> StateRegions:
        """The component and where its slots live (``device`` as the KV pool names it), for
        the transfer that sends them."""
        return StateRegions(self.component(), self.base_addrs(), device)


def linear_component(
    spec: LinearAttentionSpec, num_slots: int, conv_dtype: torch.dtype
) -> StateComponent:
    """The component a pool of ``num_slots`` slots of ``spec``'s heads holds."""
    conv = (spec.conv_dim, spec.conv_kernel - 1)
    recurrent = (spec.num_v_heads, spec.head_k_dim, spec.head_v_dim)
    conv_bytes = spec.conv_dim * (spec.conv_kernel - 1) * conv_dtype.itemsize
    recurrent_bytes = spec.num_v_heads * spec.head_k_dim * spec.head_v_dim * 4
    return StateComponent(
        kind=LINEAR_STATE,
        layer_ids=spec.linear_layers,
        tensors=(
            StateTensor("conv", conv, _DTYPE_NAMES[conv_dtype], conv_bytes),
            StateTensor("recurrent", recurrent, "float32", recurrent_bytes),
        ),
        num_items=num_slots,
    )
