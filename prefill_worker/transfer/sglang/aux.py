"""SGLang's per-request metadata ("aux") buffers, mirrored: what this worker writes into row
``aux_index`` of a decode's ``MetadataBuffers`` after the last KV page (docs/sglang.md).

A decode registers its buffers' base addresses only; the row sizes are SGLang's defaults (no
sampling mask, KV checksum, DSA top-k or speculative decoding), identical in 0.5.20-0.5.23::

    buffer                      row            written here
    output_ids                  int32[16]      [0] first token
    cached_tokens               int32[16]      [0] prompt tokens this worker's prefix cache held
    output_token_logprobs_val   float32[16]    [0] first token's logprob (when asked)
    output_token_logprobs_idx   int32[16]      [0] first token (when asked)
    output_top_logprobs_val     float32[128]   zeros (top logprobs are not computed)
    output_top_logprobs_idx     int32[128]     zeros
    output_topk_p               float32[16]    zeros (EAGLE only)
    output_topk_index           int64[16]      zeros (EAGLE only)
    output_hidden_states        float32[16]    zeros (EAGLE only)
    bootstrap_room              uint64[8]      [0] the room (the decode checks it)

Every buffer is written in full. One staging row per aux row of the worker's own
(``AuxStaging``, NIXL-registered host memory) is filled from the engine's ``AuxRow``.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxRow

AUX_BUFFERS: tuple[tuple[str, str, int], ...] = (
    ("output_ids", "<i4", 16),
    ("cached_tokens", "<i4", 16),
    ("output_token_logprobs_val", "<f4", 16),
    ("output_token_logprobs_idx", "<i4", 16),
    ("output_top_logprobs_val", "<f4", 128),
    ("output_top_logprobs_idx", "<i4", 128),
    ("output_topk_p", "<f4", 16),
    ("output_topk_index", "<i8", 16),
    ("output_hidden_states", "<f4", 16),
    ("bootstrap_room", "<u8", 8),
)
AUX_BUFFER_NAMES = tuple(name for name, _, _ in AUX_BUFFERS)
NUM_AUX_BUFFERS = len(AUX_BUFFERS)
ROW_DTYPE = np.dtype([(name, dtype, (width,)) for name, dtype, width in AUX_BUFFERS])
ITEM_BYTES = tuple(np.dtype(dtype).itemsize * width for _, dtype, width in AUX_BUFFERS)
_OFFSETS = tuple(sum(ITEM_BYTES[:i]) for i in range(NUM_AUX_BUFFERS))  # packed, in order
assert ROW_DTYPE.itemsize == sum(ITEM_BYTES) == 1600


def remote_descs(aux_ptrs: tuple[int, ...], slot: int) -> np.ndarray:
    """[10, 3] (addr, len, 0): row ``slot`` of each of the decode's buffers."""
    ptrs = np.asarray(aux_ptrs, dtype=np.uint64)
    lens = np.asarray(ITEM_BYTES, dtype=np.uint64)
    return np.stack([ptrs + np.uint64(slot) * lens, lens, np.zeros_like(lens)], axis=1)


class AuxStaging:
    """One SGLang-format row per aux row of the worker, in host memory NIXL registers once."""

    def __init__(self, num_rows: int) -> None:
        self.rows = np.zeros(num_rows, dtype=ROW_DTYPE)  # [num_rows] x 1600 bytes

    @property
    def base_addr(self) -> int:
        return int(self.rows.ctypes.data)

    @property
    def num_bytes(self) -> int:
        return int(self.rows.nbytes)

    def fill(self, row: int, aux: AuxRow, room: int) -> None:
        staged = np.zeros((), dtype=ROW_DTYPE)
        staged["output_ids"][0] = aux.first_token_id
        staged["cached_tokens"][0] = aux.num_prefix_hit_tokens or 0  # SGLang: not computed
        if not math.isnan(aux.first_token_logprob):
            staged["output_token_logprobs_val"][0] = aux.first_token_logprob
            staged["output_token_logprobs_idx"][0] = aux.first_token_id
        staged["bootstrap_room"][0] = room
        self.rows[row] = staged

    def local_descs(self, row: int) -> np.ndarray:
        """[10, 3] (addr, len, 0): the staged row, buffer by buffer."""
        start = self.base_addr + row * ROW_DTYPE.itemsize
        addrs = np.asarray(_OFFSETS, dtype=np.uint64) + np.uint64(start)
        lens = np.asarray(ITEM_BYTES, dtype=np.uint64)
        return np.stack([addrs, lens, np.zeros_like(lens)], axis=1)


class AuxRowsView:
    """The engine's aux rows (``kv.aux.AuxPool``), read through the address the transfer
    backend is given for them: the engine writes a row before ``send_aux`` names it."""

    def __init__(self, base_addr: int, num_rows: int) -> None:
        raw = (ctypes.c_uint8 * (num_rows * AUX_ROW_BYTES)).from_address(base_addr)
        self._rows = np.ctypeslib.as_array(raw).reshape(num_rows, AUX_ROW_BYTES)

    def read(self, row: int) -> AuxRow:
        return AuxRow.unpack(self._rows[row].tobytes())
