"""The linear layers' state in vLLM 0.34's page layout, for a hybrid model's (Qwen3-Next,
Qwen3.5) vLLM decodes to READ: one region per linear layer beside the KV staging region,
registered with the same agent, block ``b`` of every layer holding the state of the request
whose KV occupies staging block ``b`` last (``groups``: a mamba group's block list is that one
block). A page is vLLM's ``MambaSpec`` page padded to the attention page (``block_bytes``)::

    page of layer l, block b   [ conv [conv_dim, kernel - 1] | recurrent [Hv, Dv, Dk] | pad ]
                                 conv_bytes                  rec_bytes

The conv state is ours byte for byte (vLLM's "DS" layout, in the model dtype as vLLM's
``mamba_cache_dtype`` auto); the recurrent matrix is ours ``[Hv, Dk, Dv]`` (fp32) transposed
and cast to the decode's ``mamba_ssm_cache_dtype`` (``ssm_dtype``: vLLM's connector reads
``rec_bytes`` of its own dtype and checks nothing, so a wrong one reads garbage).
``write(slot, block)`` copies a request's slot (the state after its whole prompt, which the
HTTP front cut one token short for vLLM: docs/models.md) when its last chunk is handed over,
off the engine thread (``desk.stage_state``).
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer.vllm.staging import StagingRefused

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"  # transfer.vllm_mamba_ssm_dtype: what vLLM's decode picks by default


@dataclass(frozen=True, slots=True)
class StatePage:
    """One linear layer's page, as vLLM's metadata says it (``ssm_sizes``)."""

    conv_bytes: int
    rec_bytes: int
    page_bytes: int

    @property
    def ssm_sizes(self) -> tuple[int, int]:
        return (self.conv_bytes, self.rec_bytes)


def decode_ssm_dtype(setting: str, model_dir: str, model_dtype: str) -> str:
    """The decode's recurrent-state dtype: ``setting`` unless ``auto``; then vLLM 0.34's
    default, the checkpoint's ``mamba_ssm_dtype`` (Qwen3.5 configs name float32) if its
    ``config.json`` (or its ``text_config``) has one, else the model dtype (Qwen3-Next)."""
    if setting != AUTO:
        return setting
    path = Path(model_dir) / "config.json"
    raw: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    for config in (raw.get("text_config") or {}, raw):
        if isinstance(config.get("mamba_ssm_dtype"), str):
            return str(config["mamba_ssm_dtype"])
    return model_dtype


class StateStaging:
    """One page region per linear layer of ``state``, ``num_blocks`` pages of ``page_bytes``,
    the recurrent matrix written in ``ssm_dtype`` (one of ``DTYPES``)."""

    def __init__(
        self, state: StateRegions, num_blocks: int, page_bytes: int, ssm_dtype: str = "float32"
    ) -> None:
        conv, rec = state.component.tensors
        if conv.dtype not in DTYPES or rec.dtype not in DTYPES or ssm_dtype not in DTYPES:
            raise StagingRefused(
                f"vLLM state staging: conv {conv.dtype}, recurrent {rec.dtype} -> {ssm_dtype}: "
                f"each must be one of {list(DTYPES)}"
            )
        self._rec_dtype, self._ssm_dtype = DTYPES[rec.dtype], DTYPES[ssm_dtype]
        num_v, dk, dv = rec.item_shape
        rec_bytes = num_v * dk * dv * self._ssm_dtype.itemsize
        self.page = StatePage(conv.item_bytes, rec_bytes, page_bytes)
        if conv.item_bytes + rec_bytes > page_bytes:
            raise StagingRefused(
                f"a linear layer's state ({conv.item_bytes + rec_bytes} bytes) is larger than "
                f"a vLLM attention page ({page_bytes}): raise transfer.vllm_block_size to the "
                "decode's (vLLM raises its block size until the state fits)"
            )
        self._state, self._num_blocks = state, num_blocks
        num_layers = len(state.component.layer_ids)
        self._buffer = torch.zeros((num_layers, num_blocks, page_bytes), dtype=torch.uint8)
        self.region_base_addrs = tuple(
            self._buffer.data_ptr() + i * num_blocks * page_bytes for i in range(num_layers)
        )
        self.region_bytes = num_blocks * page_bytes

    def register(self, agent: Any) -> Any:
        """The regions registered with ``agent`` (NIXL); its handle, to deregister."""
        rows = [[addr, self.region_bytes, 0] for addr in self.region_base_addrs]
        return agent.register_memory(np.array(rows, dtype=np.uint64), "DRAM")

    def write(self, slot: int, block: int) -> int:
        """The state of ``slot`` into page ``block`` of every linear layer; the bytes."""
        rec = self._state.component.tensors[1]
        num_v, dk, dv = rec.item_shape
        conv_bytes, rec_bytes = self.page.ssm_sizes
        for layer in range(len(self._state.component.layer_ids)):
            page = self._buffer[layer, block]
            page[:conv_bytes].copy_(_item(self._state.base_addrs[0][layer], slot, conv_bytes))
            matrix = _item(self._state.base_addrs[1][layer], slot, rec.item_bytes)
            ours = matrix.view(self._rec_dtype).view(num_v, dk, dv)
            vllm = ours.transpose(1, 2).to(self._ssm_dtype).contiguous()  # [Hv, Dv, Dk]
            page[conv_bytes : conv_bytes + rec_bytes].copy_(vllm.view(-1).view(torch.uint8))
        return len(self._state.component.layer_ids) * (conv_bytes + rec_bytes)

    def page_view(self, layer: int, block: int) -> torch.Tensor:
        return self._buffer[layer, block]


def _item(base_addr: int, slot: int, item_bytes: int) -> torch.Tensor:
    """Slot ``slot`` of a state tensor whose slot 0 is at ``base_addr`` (host memory), as
    bytes: a view, not a copy."""
    address = base_addr + slot * item_bytes
    return torch.frombuffer((ctypes.c_uint8 * item_bytes).from_address(address), dtype=torch.uint8)
