"""A draft model's first proposal per request, kept beside the aux rows (``model.draft``).

One row per aux row of the worker (a request's draft row is its aux row's index), in one
contiguous host buffer whose address is stable (numpy owns it)::

    field        type              what
    num_topk     int32             k, the proposal's width; 0: no proposal written
    topk_p       float32[16]       [:k] the draft's top-k probabilities, descending
    topk_index   int64[16]         [:k] their token ids
    hidden       uint8[H]          the draft's last hidden state, the model dtype's bytes

The drafting runner writes a request's row on the chunk that ends its prompt; a transfer
backend reads it when it stages that request's aux row. A row is overwritten by the next
request that holds the same aux row, so it needs no freeing. Torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefill_worker.batch import DraftRow

MAX_TOPK = 16  # SGLang's output_topk_p / output_topk_index rows are 16 wide


def row_dtype(hidden_bytes: int) -> np.dtype:
    return np.dtype(
        [
            ("num_topk", "<i4"),
            ("topk_p", "<f4", (MAX_TOPK,)),
            ("topk_index", "<i8", (MAX_TOPK,)),
            ("hidden", "u1", (hidden_bytes,)),
        ]
    )


class DraftRows:
    """``num_rows`` draft rows of a ``hidden_bytes`` hidden state each."""

    def __init__(self, num_rows: int, hidden_bytes: int) -> None:
        assert num_rows > 0 and hidden_bytes > 0
        self.num_rows, self.hidden_bytes = num_rows, hidden_bytes
        self.rows = np.zeros(num_rows, dtype=row_dtype(hidden_bytes))  # [num_rows]

    @property
    def base_addr(self) -> int:
        return int(self.rows.ctypes.data)

    @property
    def row_bytes(self) -> int:
        return int(self.rows.dtype.itemsize)

    def write(self, row: int, draft: DraftRow) -> None:
        """``ValueError`` for a proposal that does not fit the row (the caller's request fails)."""
        k = len(draft.topk_p)
        if not 1 <= k <= MAX_TOPK or len(draft.topk_index) != k:
            raise ValueError(
                f"a draft proposal of {k} probabilities and {len(draft.topk_index)} ids; "
                f"a row holds 1 to {MAX_TOPK} of each"
            )
        if len(draft.hidden) != self.hidden_bytes:
            raise ValueError(
                f"the draft's hidden state is {len(draft.hidden)} bytes; a row holds "
                f"{self.hidden_bytes}"
            )
        staged: Any = np.zeros((), dtype=self.rows.dtype)
        staged["num_topk"] = k
        staged["topk_p"][:k] = draft.topk_p
        staged["topk_index"][:k] = draft.topk_index
        staged["hidden"][:] = np.frombuffer(draft.hidden, dtype=np.uint8)
        self.rows[row] = staged

    def read(self, row: int) -> DraftRow | None:
        """The proposal written into ``row``, or None when none was."""
        staged: Any = self.rows[row]  # one structured row
        k = int(staged["num_topk"])
        if k == 0:
            return None
        topk_p = tuple(float(p) for p in staged["topk_p"][:k])
        topk_index = tuple(int(i) for i in staged["topk_index"][:k])
        return DraftRow(topk_p, topk_index, staged["hidden"].tobytes())
