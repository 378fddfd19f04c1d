"""NixlSender against a scripted NIXL agent: it never calls back (what the backend must do
comes out as events), ``close()`` never waits, and ``written_bytes`` counts what landed."""

from __future__ import annotations

from typing import Any

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, PreppedLists
from prefill_worker.transfer.nixl.context import Closed, Peer, SendContext, Tell
from prefill_worker.transfer.nixl.sender import NixlSender

LAYOUT = KVLayout(2, 1, 8, "float32", 4, 16)  # page_bytes = 4 * 1 * 8 * 4 = 128


class Handle:
    def __init__(self, refuse_release: bool) -> None:
        self.state, self.refuse_release, self.is_released = "PROC", refuse_release, False

    def release(self) -> None:
        if self.refuse_release:
            raise NIXL_ERRORS[0]("cannot cancel")
        self.is_released = True


class Agent:
    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.refuse_release = False

    def make_prepped_xfer(self, *args: Any) -> Handle:
        self.handles.append(Handle(self.refuse_release))
        return self.handles[-1]

    def transfer(self, handle: Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: Handle) -> str:
        return handle.state


def bound_sender(agent: Agent) -> tuple[NixlSender, SendContext]:
    ctx = SendContext(agent, PreppedLists("kv", "aux"), LAYOUT, 5.0, lambda: 100.0)
    regions = KVRegions(LAYOUT, (4096, 8192), (12288, 16384), "cpu", 20480, 4)
    peer = Peer(b"decode-1", "decode-1", regions, PreppedLists("kv", "aux"), 100.0)
    sender = NixlSender(ctx, 7, "req-7", 16)
    sender.bind(peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    assert sender.poll() is KVPoll.READY and not ctx.events
    return sender, ctx


def test_a_push_reports_success_through_events_and_counts_landed_bytes() -> None:
    agent = Agent()
    sender, ctx = bound_sender(agent)
    sender.send_pages([0, 1, 2, 3], 0)
    sender.send_aux(1)
    sender.progress()
    assert sender.written_bytes() == 0 and sender.needs_progress  # nothing landed yet
    agent.handles[0].state = "DONE"
    sender.progress()  # the pages landed: the aux row is posted
    assert sender.written_bytes() == 4 * 2 * 2 * 128  # 4 pages x (K, V) x 2 layers
    agent.handles[1].state = "DONE"
    sender.progress()
    [tell] = ctx.events
    assert isinstance(tell, Tell) and tell.status.status == "ok" and tell.confirm is sender
    assert sender.poll() is KVPoll.TRANSFERRING and not sender.needs_progress
    sender.confirm_ok(True)
    assert sender.poll() is KVPoll.SUCCESS
    assert sender.written_bytes() == 4 * 2 * 2 * 128 + AUX_ROW_BYTES


def test_an_undelivered_ok_fails_the_request() -> None:
    agent = Agent()
    sender, ctx = bound_sender(agent)
    sender.send_pages([0, 1, 2, 3], 0)
    sender.send_aux(1)
    for handle_index in (0, 1):
        sender.progress()
        agent.handles[handle_index].state = "DONE"
    sender.progress()
    ctx.events.clear()
    sender.confirm_ok(False)
    assert sender.poll() is KVPoll.FAILED
    assert "unreachable" in (sender.failure_reason() or "")


def test_close_with_a_write_in_flight_cancels_it_without_waiting() -> None:
    agent = Agent()
    sender, ctx = bound_sender(agent)
    sender.send_pages([0, 1], 0)
    sender.close()
    assert agent.handles[0].is_released and sender.num_inflight == 0
    tell, closed = ctx.events
    assert isinstance(tell, Tell) and tell.identity == b"decode-1"
    assert tell.status.status == "failed"
    assert closed == Closed(sender, ())
    assert sender.written_bytes() == 0  # cancelled, never landed


def test_a_handle_nixl_will_not_release_goes_to_the_backend() -> None:
    agent = Agent()
    agent.refuse_release = True
    sender, ctx = bound_sender(agent)
    sender.send_pages([0, 1], 0)
    sender.close()
    tell, closed = ctx.events
    assert isinstance(closed, Closed) and len(closed.stuck) == 1
    [stuck] = closed.stuck
    assert stuck.is_refused and not stuck.is_settled
    # the `failed` status waits for that write: the decode may reuse the pages once told
    assert isinstance(tell, Tell) and tell.after == (stuck,)
    agent.handles[0].refuse_release = False
    stuck.release()  # what the backend's reaper retries
    assert stuck.is_settled and agent.handles[0].is_released


def test_a_failure_status_waits_for_the_writes_in_flight() -> None:
    agent = Agent()
    sender, ctx = bound_sender(agent)
    sender.send_pages([0, 1], 0)
    sender.fail("transfer deadline")
    [tell] = ctx.events
    assert isinstance(tell, Tell) and tell.status.status == "failed"
    [write] = tell.after
    assert not write.is_settled  # still copying: the backend holds the status
    sender.close()
    assert write.is_settled and agent.handles[0].is_released
