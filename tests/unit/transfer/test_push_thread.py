"""The transfer thread against a scripted NIXL agent: writes are posted and checked on it, the
caller never waits for a copy, control work overtakes queued posts, a write released before
it was posted is never sent, refused releases are retried, and every state change writes the
wake fd. Each test holds the thread inside a ``transfer()`` with an event where it needs an
order, never a sleep."""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.nixl.push_thread import PushThread
from tests.polling import wait_until


class Handle:
    def __init__(self, name: str) -> None:
        self.name, self.state, self.is_released, self.refusals = name, "PROC", False, 0

    def release(self) -> None:
        if self.refusals:
            self.refusals -= 1
            raise NIXL_ERRORS[0]("cannot cancel")
        self.is_released = True


class Agent:
    """Records calls; ``transfer`` of a write named in ``holds`` waits for its event."""

    def __init__(self) -> None:
        self.posted: list[str] = []
        self.handles: dict[str, Handle] = {}
        self.holds: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.post_result: dict[str, str] = {}
        self.thread_names: set[str] = set()

    def make_prepped_xfer(
        self, op: str, local: Any, lidx: Any, remote: Any, ridx: Any, notif: bytes
    ):  # type: ignore[no-untyped-def]
        self.thread_names.add(threading.current_thread().name)
        self.handles[notif.decode()] = Handle(notif.decode())
        return self.handles[notif.decode()]

    def transfer(self, handle: Handle) -> str:
        self.entered.setdefault(handle.name, threading.Event()).set()
        if handle.name in self.holds:
            assert self.holds[handle.name].wait(10)
        self.posted.append(handle.name)
        return self.post_result.get(handle.name, "PROC")

    def check_xfer_state(self, handle: Handle) -> str:
        return handle.state


@pytest.fixture
def rig() -> Iterator[tuple[PushThread, Agent]]:
    agent = Agent()
    thread = PushThread(agent, name="test-push")
    yield thread, agent
    for event in agent.holds.values():
        event.set()
    thread.close()


def post(thread: PushThread, name: str):  # type: ignore[no-untyped-def]
    return thread.post("local", [1], "remote", [2], name.encode(), 100)


def is_readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_write_is_posted_and_finished_on_the_thread_and_wakes_the_caller(rig) -> None:
    thread, agent = rig
    write = post(thread, "a")
    wait_until(lambda: "a" in agent.posted, 5.0, "the post")
    assert write.state() == "PROC" and not write.is_settled
    thread.clear_wake()
    agent.handles["a"].state = "DONE"
    wait_until(lambda: write.state() == "DONE", 5.0, "DONE")
    assert write.is_settled and agent.handles["a"].is_released
    wait_until(lambda: is_readable(thread.wake_fd), 5.0, "the wake fd")
    assert agent.thread_names == {"test-push"}  # NIXL was called on the transfer thread only


def test_a_write_released_before_it_was_posted_is_never_sent(rig) -> None:
    thread, agent = rig
    agent.holds["first"] = threading.Event()
    post(thread, "first")
    agent.entered.setdefault("first", threading.Event()).wait(5)
    queued = post(thread, "queued")  # waits behind the held copy
    queued.release()
    assert queued.is_settled  # at once: nothing was sent, nothing can land
    agent.holds["first"].set()
    wait_until(lambda: agent.posted == ["first"], 5.0, "the first post")
    after = post(thread, "after")
    wait_until(lambda: "after" in agent.posted, 5.0, "a later post")
    assert "queued" not in agent.posted and after.state() == "PROC"


def test_control_work_overtakes_queued_posts(rig) -> None:
    thread, agent = rig
    agent.holds["first"] = threading.Event()
    post(thread, "first")
    agent.entered.setdefault("first", threading.Event()).wait(5)
    post(thread, "second")
    order: list[str] = []
    thread.run_later(order.append, "control")
    agent.holds["first"].set()
    assert thread.run(lambda: "ran on the thread") == "ran on the thread"
    wait_until(lambda: "second" in agent.posted, 5.0, "the second post")
    assert order == ["control"] and agent.posted == ["first", "second"]


def test_run_raises_what_the_call_raised(rig) -> None:
    thread, _ = rig

    def boom() -> None:
        raise NIXL_ERRORS[0]("refused")

    with pytest.raises(NIXL_ERRORS[0], match="refused"):
        thread.run(boom)


def test_a_refused_release_is_retried_until_it_settles(rig) -> None:
    thread, agent = rig
    write = post(thread, "w")
    wait_until(lambda: "w" in agent.posted, 5.0, "the post")
    agent.handles["w"].refusals = 1
    write.release()
    wait_until(lambda: write.is_refused, 5.0, "the refusal")
    assert not write.is_settled
    write.release()  # what the reaper does on its next poll
    wait_until(lambda: write.is_settled, 5.0, "the retried release")
    assert agent.handles["w"].is_released


def test_a_write_that_fails_to_start_is_an_error_state(rig) -> None:
    thread, agent = rig
    agent.post_result["bad"] = "ERR"
    write = post(thread, "bad")
    wait_until(lambda: write.state() != "PROC", 5.0, "the failure")
    assert write.state() == "ERR (the write failed to start: ERR)" and write.is_settled


def test_close_releases_writes_in_flight_and_refuses_new_ones() -> None:
    agent = Agent()
    thread = PushThread(agent)
    write = post(thread, "inflight")
    wait_until(lambda: "inflight" in agent.posted, 5.0, "the post")
    thread.close()
    assert write.is_settled and agent.handles["inflight"].is_released
    late = post(thread, "late")
    assert late.state().startswith("ERR") and late.is_settled
    assert thread.run(lambda: 7) == 7  # after close the caller owns the agent again


def test_post_with_builds_the_handle_on_the_thread_and_tells_on_change() -> None:
    agent = Agent()
    changes = threading.Event()
    thread = PushThread(agent, name="test-push", on_change=changes.set)
    try:
        built_on: list[str] = []

        def prepare(owner: Agent) -> Handle:
            built_on.append(threading.current_thread().name)
            owner.handles["aux"] = Handle("aux")
            return owner.handles["aux"]

        write = thread.post_with(prepare, 64, 1)
        wait_until(lambda: "aux" in agent.posted, 5.0, "the post")
        assert built_on == ["test-push"] and write.num_bytes == 64
        changes.clear()
        agent.handles["aux"].state = "DONE"
        wait_until(lambda: write.state() == "DONE", 5.0, "DONE")
        assert changes.wait(5.0), "on_change was not called"

        def refuse(owner: Agent) -> Handle:
            raise NIXL_ERRORS[0]("no such descriptor")

        bad = thread.post_with(refuse, 64, 1)
        wait_until(lambda: bad.state() != "PROC", 5.0, "the failure")
        assert "could not prepare the write: no such descriptor" in bad.state()
        assert bad.is_settled
    finally:
        thread.close()
