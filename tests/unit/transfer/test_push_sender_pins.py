"""Pins for one push sender (both dialects, on test_push_sender's scripted NIXL agent):
behaviours that mutation testing (`make mutation`, scripts/mutation.py) found no test held."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.pagemap import check_want
from prefill_worker.transfer.push import sender as sender_module
from prefill_worker.transfer.push.sender import Closed, PushSender, Tell
from tests.unit.transfer.test_push_sender import LAYOUT, REGIONS, Rig


@pytest.fixture(params=["native", "sglang"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(request.param)


def tells(rig: Rig) -> list[Tell[Any]]:
    return [event for event in rig.ctx.events if isinstance(event, Tell)]


def test_before_its_want_a_sender_has_no_cached_tokens_reason_or_prep_time(rig: Rig) -> None:
    sender = rig.hub.create_sender(7, "req-7", 16)
    assert sender.num_cached_tokens() == 0 and sender.failure_reason() is None
    assert sender.prep_s == 0.0 and sender.prep_cpu_s == 0.0
    sender.bind(rig.peer, wire.Want.of(7, [4, 5, 6], 2, 4))  # the decode holds one page
    assert sender.poll() is KVPoll.READY and sender.num_cached_tokens() == 4


def test_a_want_the_prompt_cannot_fill_fails_with_check_wants_reason(rig: Rig) -> None:
    sender = rig.hub.create_sender(7, "req-7", 16)
    want = wire.Want.of(7, [3], 2, 0)  # one page for a prompt of four
    why = check_want(want, 16, LAYOUT, REGIONS)
    assert why is not None
    sender.bind(rig.peer, want)
    assert sender.poll() is KVPoll.FAILED and sender.failure_reason() == why
    [tell] = tells(rig)
    assert (tell.status.status, tell.status.reason, tell.confirm) == ("failed", why, None)


def test_pages_past_the_want_fail_with_the_reason(rig: Rig) -> None:
    sender = rig.bound_sender()  # four pages named
    sender.send_pages([0, 1, 2, 3, 4], 0)
    assert sender.poll() is KVPoll.FAILED and not rig.agent.handles
    assert sender.failure_reason() == "prompt pages up to 5 exceed the want"


def test_a_failed_status_asks_no_confirmation_and_carries_no_generation(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.fail("boom")
    [tell] = tells(rig)
    assert (tell.status.status, tell.confirm, tell.generation) == ("failed", None, None)
    assert sender.failure_reason() == "boom"


def test_an_abort_before_the_want_is_told_without_the_aborts_generation(rig: Rig) -> None:
    sender = rig.hub.create_sender(7, "req-7", 16)
    sender.abort_by_peer(5)  # no peer yet: nothing to acknowledge to
    sender.bind(rig.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    [tell] = tells(rig)
    assert (tell.status.status, tell.generation, tell.confirm) == ("failed", None, None)


def test_a_write_past_its_deadline_fails_the_request_with_the_reason(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0], 0)
    rig.now += 10.0  # the write timeout is 5 s
    sender.progress()
    assert sender.poll() is KVPoll.FAILED
    assert isinstance(sender.failure_reason(), str) and sender.failure_reason()


def test_no_aux_row_is_posted_before_send_aux_or_after_a_failure(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0], 0)
    rig.land(0)
    sender.progress()  # the pages landed, no aux row given: nothing more to post
    assert len(rig.agent.handles) == 1 and not sender.needs_progress and not tells(rig)
    sender.send_aux(1)
    sender.fail("boom")
    sender.progress()
    assert len(rig.agent.handles) == 1 and not sender.needs_progress


def test_page_writes_go_to_the_peers_kv_list(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0], 0)
    [handle] = rig.agent.handles
    assert handle.args[3] is rig.peer.lists.kv


def test_close_twice_closes_once(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.close()
    sender.close()
    assert sender.is_closed
    assert [type(e) for e in rig.ctx.events] == [Tell, Closed]


def test_an_abort_is_acknowledged_once(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.abort_by_peer(3)
    sender.progress()
    sender.progress()
    assert [(t.status.status, t.generation) for t in tells(rig)] == [("aborted", 3)]
    assert not sender.needs_progress


def test_losing_the_peer_owes_no_acknowledgement(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.send_pages([0], 0)
    sender.abort_by_peer(3)  # a write flies: the acknowledgement waits
    assert sender.needs_progress
    sender.lose_peer("gone")
    assert not sender.needs_progress


def test_calls_before_ready_are_caller_bugs_that_say_so(rig: Rig) -> None:
    sender = rig.hub.create_sender(7, "req-7", 16)
    with pytest.raises(AssertionError, match=r"^send_pages before READY$"):
        sender.send_pages([0], 0)
    with pytest.raises(AssertionError, match=r"^send_aux before READY$"):
        sender.send_aux(1)


class Ticking:
    """Each reading one second after the last: a post's index building takes 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class TickingTime:
    def __init__(self) -> None:
        self.perf_counter, self.thread_time = Ticking(), Ticking()


def test_index_building_time_adds_up_over_posts(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    sender: PushSender[Any] = rig.bound_sender()
    ticking = TickingTime()
    monkeypatch.setattr(sender_module, "time", ticking)
    sender.send_pages([0], 0)
    sender.send_pages([1], 1)
    rig.land(0)
    rig.land(1)
    sender.progress()
    # 1 s of index building per post (the writes' own prep time is real: microseconds)
    assert 2.0 <= sender.prep_s < 2.5 and 2.0 <= sender.prep_cpu_s < 2.5


def test_every_status_carries_the_requests_traceparent(rig: Rig) -> None:
    """For the decode's trace (docs/observability.md): the span the sender was given goes in
    each status it tells."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = rig.hub.create_sender(7, "req-7", 16, traceparent=parent)
    rig.hub.want(rig.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    traced.fail("boom")
    [tell] = tells(rig)
    assert (tell.status.status, tell.status.traceparent) == ("failed", parent)


def test_a_sender_given_no_traceparent_leaves_it_out(rig: Rig) -> None:
    rig.bound_sender().fail("boom")
    [tell] = tells(rig)
    assert tell.status.traceparent is msgspec.UNSET
