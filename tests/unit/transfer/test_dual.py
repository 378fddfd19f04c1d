"""Both protocols at once: a request's room goes to the first protocol whose decode claims it
(or aborts it); the other protocol's sender is failed with a reason that says so, and closed."""

from __future__ import annotations

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.dual import DualSender
from tests.unit.scheduler.fakes import FakeBackend, FakeSender


def pair() -> tuple[DualSender, FakeSender, FakeSender]:
    native = FakeBackend(PagePool(8), AuxPool(2)).create_sender(5, "r", 12)
    sglang = FakeBackend(PagePool(8), AuxPool(2)).create_sender(5, "r", 12)
    return DualSender([native, sglang], ["native", "sglang"]), native, sglang


def test_the_first_decode_to_claim_the_room_takes_it() -> None:
    dual, native, sglang = pair()
    assert dual.poll() is KVPoll.BOOTSTRAPPING
    sglang.want(num_cached_tokens=4)
    assert dual.poll() is KVPoll.READY and dual.num_cached_tokens() == 4
    assert native.is_closed and native.failure_reason() == (
        "the room was taken by a decode on the sglang protocol"
    )
    pages = sglang.backend.pool.try_alloc(2)
    assert pages is not None
    dual.send_pages(pages, 0)
    assert sglang.sent == [(tuple(pages), 0)] and not native.sent
    native.want()  # too late: nothing reaches the closed one
    assert dual.poll() is KVPoll.TRANSFERRING
    dual.close()
    assert sglang.is_closed and not native.errors and not sglang.errors


def test_a_failure_before_any_claim_fails_both() -> None:
    dual, native, sglang = pair()
    dual.fail("deadline_exceeded")
    assert dual.poll() is KVPoll.FAILED and dual.failure_reason() == "deadline_exceeded"
    assert native.state is KVPoll.FAILED
    dual.close()
    assert native.is_closed and sglang.is_closed
    assert not native.errors and not sglang.errors


def test_an_abort_before_the_request_ends_it() -> None:
    dual, native, sglang = pair()
    native.decode_abort()
    assert dual.poll() is KVPoll.ABORTED
    assert sglang.is_closed and sglang.state is KVPoll.FAILED
    assert dual.written_bytes() == 0
