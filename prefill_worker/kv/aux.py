"""Aux rows: per-request metadata pushed after the last KV chunk (first token and logprob).

One fixed-size little-endian row per request in flight (``AUX_ROW_BYTES`` = 32: first token
id, its logprob, prompt, cached and computed token counts, flags), in one contiguous buffer
that the transfer backend registers once. The row's byte layout, what each field means and how
a decode reads it are in docs/protocol.md ("Layout and compatibility"); ``_ROW`` packs
``AuxRow``'s fields in that order.

``AuxPool`` owns the buffer and hands out row indices; it never blocks and returns None
when full. Torch-free: numpy owns the memory so its address is stable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

AUX_ROW_BYTES = 32
_ROW = struct.Struct("<qfiiIi4x")
FLAG_VALID = 1
assert _ROW.size == AUX_ROW_BYTES


@dataclass(frozen=True, slots=True)
class AuxRow:
    first_token_id: int
    first_token_logprob: float
    num_prompt_tokens: int
    num_cached_tokens: int
    flags: int = FLAG_VALID
    num_computed_tokens: int = 0

    @property
    def num_prefix_hit_tokens(self) -> int | None:
        """Prompt tokens that came from the worker's prefix cache; None when not reported."""
        if self.num_computed_tokens <= 0:
            return None
        return self.num_prompt_tokens - self.num_computed_tokens

    def pack(self) -> bytes:
        return _ROW.pack(
            self.first_token_id,
            self.first_token_logprob,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.flags,
            self.num_computed_tokens,
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> AuxRow:
        return cls(*_ROW.unpack(bytes(raw[:AUX_ROW_BYTES])))


class AuxPool:
    """A fixed set of aux rows in one registered buffer, with a free list."""

    def __init__(self, num_rows: int) -> None:
        assert num_rows > 0
        self.num_rows = num_rows
        self.buffer = np.zeros((num_rows, AUX_ROW_BYTES), dtype=np.uint8)  # [rows, 32]
        self._free = list(range(num_rows - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def base_addr(self) -> int:
        return int(self.buffer.ctypes.data)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def try_alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        assert row in self._used, f"aux row {row} is not allocated"
        self._used.remove(row)
        self.buffer[row] = 0
        self._free.append(row)

    def write(self, row: int, value: AuxRow) -> None:
        assert row in self._used, f"aux row {row} is not allocated"
        self.buffer[row] = np.frombuffer(value.pack(), dtype=np.uint8)

    def read(self, row: int) -> AuxRow:
        return AuxRow.unpack(self.buffer[row].tobytes())

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.num_rows
        assert not self._used.intersection(self._free)
        assert len(set(self._free)) == len(self._free)
