"""The linear layers' state in vLLM 0.34's page layout, for a hybrid model's (Qwen3-Next,
Qwen3.5) vLLM decodes to READ: one region per linear layer beside the KV staging region,
registered with the same agent, block ``b`` of every layer holding the state of the request
whose KV occupies staging block ``b`` last (``groups``: a mamba group's block list is that one
block). A page is vLLM's ``MambaSpec`` page padded to the attention page (``block_bytes``)::

    page of layer l, block b   [ conv [conv_dim, kernel - 1] | recurrent [Hv, Dv, Dk] | pad ]
                                 conv_bytes                  rec_bytes

The conv state is ours byte for byte (vLLM's "DS" layout); the recurrent matrix is ours
``[Hv, Dk, Dv]`` transposed. ``write(slot, block)`` copies a request's slot (the state after
its whole prompt, which the HTTP front cut one token short for vLLM: docs/models.md) when its
last chunk is handed over.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer.vllm.staging import StagingRefused

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass(frozen=True, slots=True)
class StatePage:
    """One linear layer's page, as vLLM's metadata says it (``ssm_sizes``)."""

    conv_bytes: int
    rec_bytes: int
    page_bytes: int

    @property
    def ssm_sizes(self) -> tuple[int, int]:
        return (self.conv_bytes, self.rec_bytes)


class StateStaging:
    """One page region per linear layer of ``state``, ``num_blocks`` pages of ``page_bytes``."""

    def __init__(self, state: StateRegions, num_blocks: int, page_bytes: int) -> None:
        conv, rec = state.component.tensors
        if conv.dtype not in _NUMPY_DTYPES or rec.dtype not in _NUMPY_DTYPES:
            raise StagingRefused(f"vLLM state staging: {conv.dtype}/{rec.dtype} not staged")
        self.page = StatePage(conv.item_bytes, rec.item_bytes, page_bytes)
        if conv.item_bytes + rec.item_bytes > page_bytes:
            raise StagingRefused(
                f"a linear layer's state ({conv.item_bytes + rec.item_bytes} bytes) is larger "
                f"than a vLLM attention page ({page_bytes}): raise transfer.vllm_block_size "
                "to the decode's (vLLM raises its block size until the state fits)"
            )
        self._state, self._num_blocks = state, num_blocks
        num_layers = len(state.component.layer_ids)
        self._buffer = np.zeros((num_layers, num_blocks, page_bytes), dtype=np.uint8)
        self.region_base_addrs = tuple(
            self._buffer.ctypes.data + i * num_blocks * page_bytes for i in range(num_layers)
        )
        self.region_bytes = num_blocks * page_bytes

    def register(self, agent: Any) -> Any:
        """The regions registered with ``agent`` (NIXL); its handle, to deregister."""
        rows = [[addr, self.region_bytes, 0] for addr in self.region_base_addrs]
        return agent.register_memory(np.array(rows, dtype=np.uint64), "DRAM")

    def write(self, slot: int, block: int) -> None:
        """The state of ``slot`` into page ``block`` of every linear layer."""
        conv, rec = self._state.component.tensors
        num_v, dk, dv = rec.item_shape
        for layer in range(len(self._state.component.layer_ids)):
            page = self._buffer[layer, block]
            page[: conv.item_bytes] = _item(self._state.base_addrs[0][layer], slot, conv.item_bytes)
            matrix = _item(self._state.base_addrs[1][layer], slot, rec.item_bytes)
            typed = matrix.view(_NUMPY_DTYPES[rec.dtype]).reshape(num_v, dk, dv)
            vllm_order = typed.transpose(0, 2, 1).reshape(-1)  # [Hv, Dv, Dk], a copy
            page[conv.item_bytes : conv.item_bytes + rec.item_bytes] = vllm_order.view(np.uint8)

    def page_view(self, layer: int, block: int) -> np.ndarray:
        return self._buffer[layer, block]


def _item(base_addr: int, slot: int, item_bytes: int) -> np.ndarray:
    """Slot ``slot`` of a state tensor whose slot 0 is at ``base_addr`` (host memory)."""
    address = base_addr + slot * item_bytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * item_bytes).from_address(address))
