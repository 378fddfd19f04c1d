"""SGLang's per-request metadata ("aux") buffers, mirrored: what this worker writes into row
``aux_index`` of a decode's ``MetadataBuffers`` after the last KV page (docs/sglang.md).

A decode registers its buffers' base addresses only; the row sizes are SGLang's defaults (no
sampling mask, KV checksum or DSA top-k), identical in 0.5.20-0.5.23::

    buffer                      row            written here
    output_ids                  int32[16]      [0] first token
    cached_tokens               int32[16]      [0] prompt tokens this worker's prefix cache held
    output_token_logprobs_val   float32[16]    [0] first token's logprob (when asked)
    output_token_logprobs_idx   int32[16]      [0] first token (when asked)
    output_top_logprobs_val     float32[128]   zeros (top logprobs are not computed)
    output_top_logprobs_idx     int32[128]     zeros
    output_topk_p               float32[16]    [:k] the draft's top-k probabilities (a draft)
    output_topk_index           int64[16]      [:k] their token ids (a draft)
    output_hidden_states        float32[16]    zeros; a speculating decode's is
                                (spec_row_dtype) the draft's hidden state: [hidden] in the
                                               draft model's dtype (batch.DraftRow.hidden)
    bootstrap_room              uint64[8]      [0] the room (the decode checks it)

Every buffer is written in full. One staging row per aux row of the worker's own
(``AuxStaging``, NIXL-registered host memory) is filled from the engine's ``AuxRow`` and,
with a draft model, its ``DraftRow`` (SGLang's ``MetadataBuffers.set_buf``: top-k into the
first k entries, the hidden state whole; its decode's ``build_eagle_disagg_draft_input`` reads
the first ``speculative_eagle_topk``).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from prefill_worker.batch import DraftRow
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
assert ROW_DTYPE.itemsize == sum(ITEM_BYTES) == 1600


def spec_row_dtype(hidden_bytes: int) -> np.dtype:
    """The row of a decode that speculates (EAGLE/MTP): ``output_hidden_states`` is the
    draft's hidden state, ``hidden_bytes`` wide (SGLang: ``spec_hidden_size`` values of the
    draft model's dtype), the other buffers as by default."""
    fields = [(n, d, (w,)) for n, d, w in AUX_BUFFERS if n != "output_hidden_states"]
    fields.insert(AUX_BUFFER_NAMES.index("output_hidden_states"), _hidden_field(hidden_bytes))
    return np.dtype(fields)


def _hidden_field(hidden_bytes: int) -> tuple[str, str, tuple[int]]:
    return ("output_hidden_states", "u1", (hidden_bytes,))


def item_bytes(row_dtype: np.dtype) -> tuple[int, ...]:
    """Each buffer's row, in bytes, in order."""
    assert row_dtype.names is not None
    return tuple(row_dtype.fields[name][0].itemsize for name in row_dtype.names)  # type: ignore[index]


def remote_descs(
    aux_ptrs: tuple[int, ...], slot: int, lens_bytes: tuple[int, ...] = ITEM_BYTES
) -> np.ndarray:
    """[10, 3] (addr, len, 0): row ``slot`` of each of the decode's buffers."""
    ptrs = np.asarray(aux_ptrs, dtype=np.uint64)
    lens = np.asarray(lens_bytes, dtype=np.uint64)
    return np.stack([ptrs + np.uint64(slot) * lens, lens, np.zeros_like(lens)], axis=1)


def without_hidden(descs: np.ndarray) -> np.ndarray:
    """A row's [10, 3] descriptors but ``output_hidden_states``'s: what a worker without a
    draft writes into a speculating decode, whose hidden row is as wide as its draft's."""
    return np.delete(descs, AUX_BUFFER_NAMES.index("output_hidden_states"), axis=0)


class AuxStaging:
    """One SGLang-format row per aux row of the worker, in host memory NIXL registers once
    (``row_dtype``: the default row, or ``spec_row_dtype``'s for speculating decodes)."""

    def __init__(self, num_rows: int, row_dtype: np.dtype = ROW_DTYPE) -> None:
        self.row_dtype, self.item_bytes = row_dtype, item_bytes(row_dtype)
        self._offsets = tuple(sum(self.item_bytes[:i]) for i in range(NUM_AUX_BUFFERS))
        self.rows = np.zeros(num_rows, dtype=row_dtype)  # [num_rows] x 1600 bytes by default

    @property
    def base_addr(self) -> int:
        return int(self.rows.ctypes.data)

    @property
    def num_bytes(self) -> int:
        return int(self.rows.nbytes)

    def fill(self, row: int, aux: AuxRow, room: int, draft: DraftRow | None = None) -> None:
        staged = np.zeros((), dtype=self.row_dtype)
        staged["output_ids"][0] = aux.first_token_id
        staged["cached_tokens"][0] = aux.num_prefix_hit_tokens or 0  # SGLang: not computed
        if not math.isnan(aux.first_token_logprob):
            staged["output_token_logprobs_val"][0] = aux.first_token_logprob
            staged["output_token_logprobs_idx"][0] = aux.first_token_id
        staged["bootstrap_room"][0] = room
        if draft is not None:
            _fill_draft(staged, draft)
        self.rows[row] = staged

    def local_descs(self, row: int) -> np.ndarray:
        """[10, 3] (addr, len, 0): the staged row, buffer by buffer."""
        start = self.base_addr + row * self.row_dtype.itemsize
        addrs = np.asarray(self._offsets, dtype=np.uint64) + np.uint64(start)
        lens = np.asarray(self.item_bytes, dtype=np.uint64)
        return np.stack([addrs, lens, np.zeros_like(lens)], axis=1)


def _fill_draft(staged: np.ndarray, draft: DraftRow) -> None:
    k, hidden = len(draft.topk_p), staged["output_hidden_states"]
    if not 1 <= k <= 16 or len(draft.topk_index) != k:
        raise ValueError(f"a draft proposal of {k} probabilities and {len(draft.topk_index)} ids")
    if hidden.dtype != np.uint8 or hidden.nbytes != len(draft.hidden):
        raise ValueError(
            f"the draft's hidden state is {len(draft.hidden)} bytes; the decode's row holds "
            f"{hidden.nbytes}"
        )
    staged["output_topk_p"][:k] = draft.topk_p
    staged["output_topk_index"][:k] = draft.topk_index
    hidden[:] = np.frombuffer(draft.hidden, dtype=np.uint8)


class AuxRowsView:
    """The engine's aux rows (``kv.aux.AuxPool``), read through the address the transfer
    backend is given for them: the engine writes a row before ``send_aux`` names it."""

    def __init__(self, base_addr: int, num_rows: int) -> None:
        raw = (ctypes.c_uint8 * (num_rows * AUX_ROW_BYTES)).from_address(base_addr)
        self._rows = np.ctypeslib.as_array(raw).reshape(num_rows, AUX_ROW_BYTES)

    def read(self, row: int) -> AuxRow:
        return AuxRow.unpack(self._rows[row].tobytes())
