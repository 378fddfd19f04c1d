"""An SGLang decode of a hybrid linear-attention model (Qwen3.5, Qwen3-Next; its ``mamba``
state component): what such a decode registers and asks, checked, and where our state goes.

SGLang 0.5.23's decode runs these models on ``HybridLinearKVPool``: its KV list holds the
full-attention layers only, K of each then V, with ``kv_layer_ids`` their model layer ids
(``get_kv_layer_ids``); and its ``MambaPool`` is one state component (``setup_state_kv_args``:
``state_types [mamba]``), one buffer per (tensor, linear layer), tensor-major (every layer's
conv, then every layer's temporal), ``[slots + 1, ...]`` each, with per buffer the bytes of
one slot, the TP-sliceable dim (conv: ``conv_dim``; temporal: ``v_heads``) and the model
layer id. Per request the decode names, as ``state_indices[0]``, one slot of that pool (its
``req_index_to_mamba_index_mapping``), and the prefill writes, with the last chunk, each of
its buffers' slot into the decode's buffer of the same layer id (``nixl/conn.py``,
``_send_mamba_state``): the state after the whole prompt, which the decode's first step
continues with the first token of the aux row. Its slot layout is not ours::

    tensor    SGLang's MambaPool item                      ours (model.state_cache)
    conv      [conv_dim, kernel - 1] in its conv dtype     the same, in the model's dtype
              (SGLANG_MAMBA_CONV_DTYPE, bfloat16 unless set)
    temporal  [v_heads, head_v_dim, head_k_dim] float32    [v_heads, head_k_dim, head_v_dim]

so a request's slot is first staged in the decode's layout (``sglang.mamba_stage``: the
recurrent matrix transposed, the conv cast to ``transfer.sglang_mamba_conv_dtype``), one
staging slot per aux row (the request's state slot is its aux row, held until it finishes), and the
staging slot is written. A decode of attention TP > 1 (SGLang slices the state per head), an
older decode (no ``state_data_lens``) or any other pool is refused by name at registration.

A decode of attention TP d > 1 (each rank holding 1/d of the heads: SGLang's
``_send_mamba_state_slice`` from a prefill of TP 1) gets, per rank, its share of each item:
the conv's q, k and v channels of its heads (``state_conv_shard_groups``) and the temporal's
value heads. The stage then puts each rank's share of an item in one run, rank after rank
(``fill(slot, d)``), so rank r is written one descriptor per (tensor, layer) from its share
of our staging slot (``nixl.state_lists.prep_share``) into its whole slot.
"""

from __future__ import annotations

import dataclasses

import msgspec

from prefill_worker.kv.state_layout import StateComponent, StateRegions, StateTensor
from prefill_worker.transfer import wire
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest
from prefill_worker.transfer.slot_stage import StagedState
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    Refusal,
    RejectReason,
    outside_address_space,
)


@dataclasses.dataclass(frozen=True, slots=True)
class MambaPool:
    """An accepted registration with a mamba pool: the registration as its KV list alone (the
    full layers, numbered as our pool's, no state) to check and map as any decode's; and its
    mamba pool, as a state component's regions in the staging's layout."""

    registration: Registration
    state: StateRegions


def accept_mamba(
    reg: Registration, side: StagedState, limits: BootstrapLimits
) -> MambaPool | Refusal:
    """The decode rank's mamba pool (its share of every slot: ``rank_share``), or why it
    cannot take this model's state."""
    if not 0 <= reg.tp_rank < reg.tp_size:
        return _unsupported(f"decode attention TP rank {reg.tp_rank} of {reg.tp_size}")
    heads = [h for _, h in side.conv_groups] + [side.num_value_heads]
    if any(h % reg.tp_size for h in heads):
        return _unsupported(
            f"a decode of attention TP {reg.tp_size} with a mamba pool: it does not split "
            f"the linear layers' heads {heads} (conv q, k, v; temporal), which SGLang would "
            "pad with extra key groups"
        )
    staged = rank_share(side.stage.regions().component, reg.tp_size)
    if len(reg.state) != 1:
        return _unsupported(
            f"the decode registered {len(reg.state)} state components; this model's decode "
            "holds one (mamba: its linear layers' conv and temporal state)"
        )
    if reg.kv_layer_ids != side.full_layers * 2:
        why = (
            f"the decode's KV list is of layers {list(reg.kv_layer_ids)[:16]}; this model's "
            f"full-attention layers are {list(side.full_layers)} (K of each, then V)"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    refusal = _check_buffers(reg, staged)
    if refusal is not None:
        return refusal
    return _mamba_pool(reg, staged, limits)


def _check_buffers(reg: Registration, staged: StateComponent) -> Refusal | None:
    mamba, layers = reg.state[0], staged.layer_ids
    num_buffers = len(staged.tensors) * len(layers)
    if len(mamba.data_ptrs) != num_buffers or len(mamba.item_lens) != num_buffers:
        why = (
            f"decode registered {len(mamba.data_ptrs)} mamba buffers; this model has "
            f"{len(layers)} linear layers ({num_buffers}: conv and temporal of each)"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    if mamba.layer_ids != layers * len(staged.tensors):
        why = (
            f"the decode's state buffers are of layers {list(mamba.layer_ids)[:16]}; this "
            f"model's linear layers are {list(layers)} (conv of each, then temporal)"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    conv, temporal = staged.tensors
    dims = (conv.item_shape[0],) * len(layers) + (temporal.item_shape[0],) * len(layers)
    if mamba.dims and mamba.dims != dims:
        why = f"the decode's state split dims {list(mamba.dims)[:16]}, this model's {list(dims)}"
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    for index, tensor in enumerate(staged.tensors):
        got = set(mamba.item_lens[index * len(layers) : (index + 1) * len(layers)])
        if got != {tensor.item_bytes}:
            return Refusal(RejectReason.LAYOUT_MISMATCH, _item_mismatch(tensor, sorted(got)))
    return None


def _item_mismatch(tensor: StateTensor, got: list[int]) -> str:
    knob = (
        "SGLANG_MAMBA_CONV_DTYPE against transfer.sglang_mamba_conv_dtype"
        if tensor.name == "conv"
        else "its SGLANG_MAMBA_SSM_DTYPE (float32 is served)"
    )
    return (
        f"the decode's {tensor.name} state slot is {got} bytes; this worker stages "
        f"{list(tensor.item_shape)} {tensor.dtype} ({tensor.item_bytes} bytes): check the "
        f"model's shapes, and {knob}"
    )


def rank_share(staged: StateComponent, num_ranks: int) -> StateComponent:
    """What one decode rank of ``num_ranks`` holds of each slot: every tensor's leading dim
    (conv channels, value heads) split evenly (a GDN conv's q, k and v each split on its own:
    ``sglang.mamba_stage`` stages them rank after rank)."""
    tensors = tuple(
        dataclasses.replace(
            t,
            item_shape=(t.item_shape[0] // num_ranks, *t.item_shape[1:]),
            item_bytes=t.item_bytes // num_ranks,
        )
        for t in staged.tensors
    )
    return dataclasses.replace(staged, tensors=tensors)


def _mamba_pool(
    reg: Registration, staged: StateComponent, limits: BootstrapLimits
) -> MambaPool | Refusal:
    mamba = reg.state[0]
    pairs = list(zip(mamba.data_lens, mamba.item_lens, strict=False))
    sizes = {length // item for length, item in pairs}
    is_whole = all(length % item == 0 for length, item in pairs)
    if len(mamba.data_lens) != len(mamba.data_ptrs) or len(sizes) != 1 or not is_whole:
        return _unsupported(
            "the decode's mamba buffers come without one slot count for all (state_data_lens, "
            "sent from SGLang 0.5.23 on)"
        )
    (num_slots,) = sizes
    if not 1 <= num_slots <= limits.max_peer_pages:
        why = (
            f"decode mamba pool of {num_slots} slots; this worker takes 1 to "
            f"{limits.max_peer_pages} (transfer.max_peer_pages)"
        )
        return Refusal(RejectReason.TOO_LARGE, why)
    runs = list(zip(mamba.data_ptrs, mamba.data_lens, strict=True))
    refusal = outside_address_space("mamba state region", runs)
    if refusal is not None:
        return refusal
    half = len(staged.layer_ids)
    component = dataclasses.replace(staged, num_items=num_slots)
    bases = (mamba.data_ptrs[:half], mamba.data_ptrs[half:])
    device = "cpu" if reg.mem_kinds[:1] == ("DRAM",) else f"cuda:{reg.gpu_id}"
    kv_only = dataclasses.replace(reg, has_state=False, state=(), kv_layer_ids=())
    return MambaPool(kv_only, StateRegions(component, bases, device))


def mamba_want(req: TransferRequest) -> wire.Want | Refusal:
    """The request's want with its mamba slot (its one state component's one index)."""
    if len(req.state_indices) != 1 or len(req.state_indices[0]) != 1:
        why = (
            f"the request names state indices {[len(i) for i in req.state_indices]}; a decode "
            "with a mamba pool names one list of one slot"
        )
        return _unsupported(why)
    return msgspec.structs.replace(req.want(), dst_state_slot=req.state_indices[0][0])


def _unsupported(why: str) -> Refusal:
    return Refusal(RejectReason.UNSUPPORTED, why)
