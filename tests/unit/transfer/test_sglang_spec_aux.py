"""The SGLang metadata row of a speculating decode (``transfer.sglang.aux``): the hidden-state
buffer as wide as the draft's hidden state, the draft's top-k in the first k entries, the
rest as the default row; a decode that runs no drafter gets the default row, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from prefill_worker.batch import DraftRow
from prefill_worker.kv.aux import AuxRow
from prefill_worker.transfer.sglang import aux

HIDDEN = np.arange(8, dtype="<f2") * 0.5  # a bf16-sized hidden of 8 values: 16 bytes
DRAFT = DraftRow((0.5, 0.25), (7, 3), HIDDEN.tobytes())
AUX = AuxRow(42, -0.5, 10, 0)


def test_the_speculating_row_carries_the_draft() -> None:
    staging = aux.AuxStaging(2, aux.spec_row_dtype(16))
    assert staging.item_bytes == (64, 64, 64, 64, 512, 512, 64, 128, 16, 64)
    staging.fill(1, AUX, room=9, draft=DRAFT)
    row = staging.rows[1]
    assert list(row["output_topk_p"][:3]) == [0.5, 0.25, 0.0]
    assert list(row["output_topk_index"][:3]) == [7, 3, 0]
    assert row["output_hidden_states"].tobytes() == HIDDEN.tobytes()
    assert (row["output_ids"][0], row["bootstrap_room"][0]) == (42, 9)
    local = staging.local_descs(1)
    assert list(local[:, 1]) == list(staging.item_bytes)
    assert local[0, 0] == staging.base_addr + staging.row_dtype.itemsize
    remote = aux.remote_descs(tuple(range(1000, 11000, 1000)), 3, staging.item_bytes)
    assert remote[8, 0] == 9000 + 3 * 16 and remote[8, 1] == 16


def test_a_decode_without_a_drafter_gets_the_default_row() -> None:
    plain, spec = aux.AuxStaging(1), aux.AuxStaging(1, aux.spec_row_dtype(64))
    plain.fill(0, AUX, room=9)
    spec.fill(0, AUX, room=9)
    assert plain.rows.tobytes() == spec.rows.tobytes() and plain.item_bytes == aux.ITEM_BYTES


@pytest.mark.parametrize(
    ("draft", "match"),
    [
        (DraftRow((0.5,), (7, 3), HIDDEN.tobytes()), "1 probabilities and 2 ids"),
        (DraftRow((0.5,) * 17, (7,) * 17, HIDDEN.tobytes()), "17 probabilities"),
        (DraftRow((0.5,), (7,), HIDDEN.tobytes()[:8]), "8 bytes; the decode's row holds 16"),
    ],
)
def test_a_draft_that_does_not_fit_the_row_is_refused(draft: DraftRow, match: str) -> None:
    staging = aux.AuxStaging(1, aux.spec_row_dtype(16))
    with pytest.raises(ValueError, match=match):
        staging.fill(0, AUX, room=9, draft=draft)
    assert not any(staging.rows.tobytes())  # nothing half-written
