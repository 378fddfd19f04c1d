"""Fault isolation in the engine (docs/reliability.md): a failure in one request's own data
(its sampled row, its sender) fails that request with a typed reason; the batch's other
requests and the engine go on, and every page and aux row comes back."""

from __future__ import annotations

import pytest

from prefill_worker.request import FinishReason
from tests.unit.scheduler.fakes import make_rig


@pytest.mark.parametrize("overlap", [False, True])
def test_a_row_that_could_not_be_sampled_fails_only_its_request(overlap: bool) -> None:
    rig = make_rig(overlap=overlap)
    rig.runner.sample_errors["bad"] = "SamplingError: the logits hold NaN"
    for rid in ("a", "bad", "b"):
        rig.prefill(rid, 6)
    rig.run_until_idle()
    bad = rig.outcome("bad")
    assert bad.reason is FinishReason.ENGINE_ERROR
    assert bad.error == "sampling failed: SamplingError: the logits hold NaN"
    assert bad.first_token_id is None
    assert rig.outcome("a").reason is FinishReason.OK
    assert rig.outcome("b").reason is FinishReason.OK
    assert rig.sender("bad").worker_failure is not None and not rig.sender("bad").aux
    rig.prefill("after", 9)
    rig.run_until_idle()
    assert rig.outcome("after").reason is FinishReason.OK
    rig.check_whole()


def test_an_exception_in_one_requests_post_processing_fails_only_it() -> None:
    rig = make_rig(chunk_size=4)
    rig.prefill("a", 10)
    rig.prefill("bad", 10)
    rig.sender("bad").send_raises = ValueError("descriptor table for this peer")
    rig.run_until_idle()
    bad = rig.outcome("bad")
    assert bad.reason is FinishReason.ENGINE_ERROR
    assert "descriptor table for this peer" in (bad.error or "")
    assert rig.outcome("a").reason is FinishReason.OK
    rig.check_whole()


def test_a_broken_invariant_still_stops_the_engine() -> None:
    rig = make_rig()
    rig.prefill("a", 6)
    rig.sender("a").send_raises = AssertionError("pages freed twice")
    with pytest.raises(AssertionError, match="freed twice"):
        rig.run_until_idle()


def test_a_sender_whose_poll_raises_fails_only_its_request() -> None:
    rig = make_rig(chunk_size=4)
    rig.prefill("a", 10)
    rig.prefill("bad", 10)
    rig.sender("bad").poll_raises = RuntimeError("NIXL: handle in an unknown state")
    rig.run_until_idle()
    bad = rig.outcome("bad")
    assert bad.reason is FinishReason.ENGINE_ERROR
    assert "unknown state" in (bad.error or "")
    assert rig.outcome("a").reason is FinishReason.OK
    rig.check_whole()
