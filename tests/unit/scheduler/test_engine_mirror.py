"""Chunks the forward also writes into the sender's destination (``MirroringSender``): the
scheduler asks the sender as it plans each chunk, a chunk planned before the claim is not
mirrored, and a request that ends while its mirrored chunk computes has its sender closed
only once that forward is collected (the fake sender records a forward writing the slots of
a closed sender as a broken contract)."""

from __future__ import annotations

import threading

import pytest

from prefill_worker.request import FinishReason
from tests.unit.scheduler.fakes import MirroringFakeSender, Rig, make_rig


def _sender(rig: Rig, request_id: str) -> MirroringFakeSender:
    sender = rig.sender(request_id)
    assert isinstance(sender, MirroringFakeSender)
    return sender


def _chunks(rig: Rig, request_id: str) -> list[tuple[int, int, bool]]:
    """(start, end, mirrored) of each chunk the runner computed for the request."""
    return [
        (c.start, c.end, bool(c.mirror_slots))
        for plan in rig.runner.plans
        for c in plan.chunks
        if c.request_id == request_id
    ]


def test_each_chunk_of_a_claimed_request_carries_its_senders_slots() -> None:
    rig = make_rig(mirror=True, chunk_size=16, max_batch_tokens=16)
    rig.prefill("a", 40)
    rig.run_until_idle()
    assert rig.outcome("a").reason is FinishReason.OK
    assert _chunks(rig, "a") == [(0, 16, True), (16, 32, True), (32, 40, True)]
    sender = _sender(rig, "a")
    assert sender.mirrored == sender.mirror_written == [(0, 16), (16, 32), (32, 40)]
    rig.check_whole()


def test_a_chunk_planned_before_the_claim_is_not_mirrored() -> None:
    rig = make_rig(mirror=True, chunk_size=8, max_batch_tokens=8, auto_want=False,
                   optimistic=True, page_size=4)  # fmt: skip
    rig.prefill("a", 20)
    rig.steps(2)  # two chunks computed optimistically, no want yet
    _sender(rig, "a").want()
    rig.run_until_idle()
    assert rig.outcome("a").reason is FinishReason.OK
    assert [mirrored for *_, mirrored in _chunks(rig, "a")] == [False, False, True]
    rig.check_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_ended_mid_forward_is_closed_after_it(overlap: bool) -> None:
    rig = make_rig(mirror=True, chunk_size=16, max_batch_tokens=16, overlap=overlap)
    gate = rig.runner.gate = threading.Event()
    rig.prefill("a", 40)
    rig.steps(1)  # chunk [0, 16) launched (overlapped: computing, held at the gate)
    rig.abort("a")
    sender = _sender(rig, "a")
    assert sender.worker_failure == "aborted by the router" and not sender.is_closed
    gate.set()
    rig.run_until_idle()
    assert sender.is_closed and sender.mirror_written == [(0, 16)]
    assert rig.outcome("a").reason is FinishReason.ABORTED_BY_ROUTER
    rig.check_whole()
