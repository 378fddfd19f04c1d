"""A decode's pool of one state component given as torch tensors, described as regions.

``tensors[t][l]`` holds tensor ``t`` (the component's order: ``conv``, ``recurrent`` for
linear-attention state) of its layer ``l`` for every slot: ``[num_items, *item_shape]``,
contiguous, the component's dtype, on the KV pool's device. Slot ``s`` of it is what the
worker writes a room's state into when the room's ``want`` names ``state_slot`` s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from prefill_worker.kv.state_layout import StateComponent, StateRegions
from prefill_worker.transfer.decode.pool import pool_device


def state_regions_from_tensors(
    component: StateComponent, tensors: Sequence[Sequence[Any]]
) -> StateRegions:
    """The regions of ``tensors`` as a pool of ``component`` (the worker's, from
    ``describe_state``; its ``num_items`` becomes the tensors' slot count). ``ValueError``
    with the reason when a tensor has the wrong shape, dtype, device or layout."""
    if len(tensors) != len(component.tensors):
        raise ValueError(
            f"{component.kind}: {len(component.tensors)} tensors per layer "
            f"({', '.join(t.name for t in component.tensors)}); got {len(tensors)}"
        )
    first = tensors[0][0] if tensors and tensors[0] else None
    if first is None:
        raise ValueError(f"{component.kind}: no tensors for its {len(component.layer_ids)} layers")
    num_items = int(first.shape[0])
    for spec, per_layer in zip(component.tensors, tensors, strict=True):
        for t in per_layer:
            _check(spec.name, spec.item_shape, spec.dtype, num_items, first.device, t)
    kept = dataclasses.replace(component, num_items=num_items)
    addrs = tuple(tuple(int(t.data_ptr()) for t in per_layer) for per_layer in tensors)
    return StateRegions(kept, addrs, pool_device(first.device))  # ValueError: layer count


def _check(
    name: str, item_shape: tuple[int, ...], dtype: str, num_items: int, device: Any, t: Any
) -> None:
    want = (num_items, *item_shape)
    got_dtype = str(t.dtype).removeprefix("torch.")
    if tuple(t.shape) != want or got_dtype != dtype or t.device != device:
        raise ValueError(
            f"state tensor {name}: each layer's is {list(want)} {dtype} on {device}; "
            f"one is {list(t.shape)} {got_dtype} on {t.device}"
        )
    if not t.is_contiguous():
        raise ValueError(f"state tensor {name}: each layer's must be contiguous")
