"""Aux rows: handed out lowest first, zeroed when freed, refused when not held; the prefix-hit
count is reported only when the computed count is."""

from __future__ import annotations

import pytest

from prefill_worker.kv.aux import AUX_ROW_BYTES, FLAG_VALID, AuxPool, AuxRow


def test_rows_go_lowest_first_come_back_zeroed_and_run_out_as_none() -> None:
    pool = AuxPool(2)
    assert (pool.num_rows, pool.num_free) == (2, 2)
    assert pool.try_alloc() == 0 and pool.try_alloc() == 1
    assert pool.num_free == 0 and pool.try_alloc() is None
    pool.write(1, AuxRow(7, -0.5, 10, 4))
    assert pool.read(1) == AuxRow(7, -0.5, 10, 4, FLAG_VALID, 0)
    pool.free(1)
    assert pool.buffer[1].tobytes() == bytes(AUX_ROW_BYTES) and pool.num_free == 1
    assert pool.try_alloc() == 1
    pool.check_integrity()


def test_a_row_not_held_cannot_be_written_or_freed_and_a_pool_needs_a_row() -> None:
    pool = AuxPool(1)
    with pytest.raises(AssertionError, match=r"^aux row 0 is not allocated$"):
        pool.write(0, AuxRow(1, 0.0, 1, 0))
    with pytest.raises(AssertionError, match=r"^aux row 0 is not allocated$"):
        pool.free(0)
    with pytest.raises(AssertionError):
        AuxPool(0)


@pytest.mark.parametrize(("computed", "hit"), [(0, None), (-1, None), (1, 9), (10, 0)])
def test_the_prefix_hit_is_the_prompt_less_the_computed_tokens_when_reported(
    computed: int, hit: int | None
) -> None:
    assert AuxRow(1, 0.0, 10, 0, FLAG_VALID, computed).num_prefix_hit_tokens == hit
