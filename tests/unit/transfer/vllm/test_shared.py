"""The staging region a tensor-parallel group shares: one rank makes it, another maps it by its
path and sees the same bytes; the file goes at ``unlink`` while the memory stays; and which
heads each rank writes (a replicated head by its first holder only)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prefill_worker.transfer.vllm.shared import SharedRegion, writer_heads


def test_a_mapped_region_shares_the_bytes_and_leaves_no_file() -> None:
    made = SharedRegion(4096)
    path = made.path
    assert path is not None and os.path.getsize(path) == 4096
    assert not made.buffer.any()
    mapped = SharedRegion(4096, path)
    made.unlink()
    assert not os.path.exists(path) and made.path is None
    made.buffer[100:108] = np.arange(8, dtype=np.uint8) + 1
    assert mapped.buffer[100:108].tolist() == list(range(1, 9))
    mapped.buffer[0] = 7
    assert made.buffer[0] == 7


def test_a_region_of_another_size_is_refused() -> None:
    made = SharedRegion(4096)
    assert made.path is not None
    try:
        with pytest.raises(ValueError, match="4096 bytes, 8192 expected"):
            SharedRegion(8192, made.path)
    finally:
        made.unlink()


@pytest.mark.parametrize(
    ("num_kv_heads", "tp_size", "want"),
    [
        (8, 2, [range(0, 4), range(4, 8)]),
        (2, 2, [range(0, 1), range(1, 2)]),
        (2, 4, [range(0, 1), None, range(1, 2), None]),
        (1, 2, [range(0, 1), None]),
    ],
)
def test_each_head_is_written_by_one_rank(
    num_kv_heads: int, tp_size: int, want: list[range | None]
) -> None:
    assert [writer_heads(num_kv_heads, r, tp_size) for r in range(tp_size)] == want
