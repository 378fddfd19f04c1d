"""Engine scenarios on a real worker process: requests whose own parameters used to crash the
sampler (issue #12) are served, interleaved with normal ones, and the worker stays whole."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

from prefill_worker.ingress.messages import Reject, Result
from prefill_worker.request import OutcomeStatus, SamplingParams
from prefill_worker.testing.launch import ChildProcess
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import ROOT
from tests.reliability.conftest import Rig, check_healthy

# Each was accepted by the protocol and made torch.multinomial raise on the engine thread
# (exit 70). Every one of them leaves only the most likely token: the greedy one.
EXTREME = (
    SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
    SamplingParams(temperature=1e-39, seed=2),
    SamplingParams(temperature=1e-45, top_p=5e-324, top_k=10_000),
    SamplingParams(temperature=100.0, top_p=5e-324, top_k=1_000, seed=2**63 - 1),
    SamplingParams(temperature=3e-6, top_p=0.3),
)


def test_normal_requests_leave_the_worker_healthy(rig: Rig) -> None:
    rooms = [rig.next_room() for _ in range(4)]
    for room in rooms:
        rig.decode.want(room, 11)
    rids = [rig.router.send_prefill(prompt(11, seed=room), room) for room in rooms]
    replies = rig.router.wait(rids)
    assert all(isinstance(r, Result) and r.status is OutcomeStatus.OK for r in replies.values()), (
        replies
    )
    for room in rig.decode.wait(rooms):
        rig.decode.release(room)
    check_healthy(rig)


def test_extreme_sampling_is_served_among_normal_requests(rig: Rig) -> None:
    pid = rig.worker.proc.pid
    sent: list[tuple[str, int, SamplingParams]] = []  # (request id, prompt seed, sampling)
    for i in range(30):
        seed, sampling = i % 6, EXTREME[i % len(EXTREME)] if i % 2 else SamplingParams()
        room = rig.next_room()
        rig.decode.want(room, 13 + seed)
        rid = rig.router.send_prefill(prompt(13 + seed, seed=seed), room, sampling=sampling)
        sent.append((rid, seed, sampling))
    replies = rig.router.wait([rid for rid, _, _ in sent], timeout_s=60)
    greedy: dict[int, int] = {}
    for rid, seed, sampling in sent:
        reply = replies[rid]
        assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
        assert reply.first_token_id is not None
        greedy.setdefault(seed, reply.first_token_id)
        assert reply.first_token_id == greedy[seed], (sampling, reply)
    for room, status in rig.decode.wait(list(rig.decode.rooms)).items():
        assert status.state.value == "done", status
        rig.decode.release(room)
    assert (
        rig.metric("prefill_worker_requests_total", {"status": "failed", "reason": "engine_error"})
        == 0
    )
    check_healthy(rig)
    assert rig.worker.proc.pid == pid


def test_scarce_pages_and_aux_rows_never_leak(rig_factory: Callable[..., Rig]) -> None:
    """A pool of 16 pages (64 tokens) and 2 aux rows under 40 requests: what fits waits its
    turn, what can never fit fails ``prompt_too_long``, a request nobody wants times out."""
    rig = rig_factory(
        "cache.num_pages=16",
        "cache.num_aux_rows=2",
        "scheduler.max_running_requests=2",
        "scheduler.bootstrap_timeout_s=1.0",
    )
    sent: dict[str, str] = {}  # request id -> expected reason
    for i in range(40):
        room, num_tokens = rig.next_room(), 20 + i % 25
        if i % 10 == 3:
            sent[rig.router.send_prefill(prompt(100, seed=i), room)] = "prompt_too_long"
            continue
        if i % 10 == 7:  # no decode ever wants it
            sent[rig.router.send_prefill(prompt(num_tokens, seed=i), room)] = "bootstrap_timeout"
            continue
        rig.decode.want(room, num_tokens)
        sent[rig.router.send_prefill(prompt(num_tokens, seed=i), room)] = "ok"
    replies = rig.router.wait(list(sent), timeout_s=60)
    for rid, expected in sent.items():
        reply = replies[rid]  # too long: a reject at the edge, or failed by the engine
        reason = reply.code.value if isinstance(reply, Reject) else reply.reason.value
        assert reason == expected, reply
    for room, status in rig.decode.wait(list(rig.decode.rooms)).items():
        assert status.state.value == "done", status
        rig.decode.release(room)
    check_healthy(rig)


PEER_FAILURES = {"peer_lost", "transfer_failed", "transfer_timeout", "bootstrap_timeout"}


def start_decode_process(rig: Rig, rooms: dict[int, int], workdir: Path) -> ChildProcess:
    """tests/reliability/decode_process.py, registered and wanting ``rooms`` (room: tokens)."""
    specs = [f"{room}:{num_tokens}" for room, num_tokens in rooms.items()]
    args = [sys.executable, "-m", "tests.reliability.decode_process", rig.worker.bootstrap]
    child = ChildProcess.start("decode", [*args, *specs], workdir, cwd=ROOT)
    try:
        child.wait_ready(60)
    except BaseException:
        child.kill()
        raise
    return child


def send_mixed(rig: Rig, victim_rooms: dict[int, int]) -> tuple[list[str], list[str]]:
    """Prefills for the victim decode's rooms, and as many for the rig's healthy decode."""
    victims = [rig.router.send_prefill(prompt(n, seed=r), r) for r, n in victim_rooms.items()]
    normal = []
    for i in range(len(victim_rooms)):
        room = rig.next_room()
        rig.decode.want(room, 10 + i)
        normal.append(rig.router.send_prefill(prompt(10 + i, seed=i), room))
    return victims, normal


def test_a_killed_decode_fails_only_its_requests(rig: Rig, tmp_path: Path) -> None:
    victim_rooms = {rig.next_room(): 9 + i for i in range(4)}
    child = start_decode_process(rig, victim_rooms, tmp_path)
    child.kill()  # SIGKILL, its wants already with the worker
    victims, normal = send_mixed(rig, victim_rooms)
    replies = rig.router.wait(victims + normal, timeout_s=60)
    for rid in normal:
        reply = replies[rid]
        assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
    for rid in victims:
        reply = replies[rid]
        assert isinstance(reply, Result) and reply.reason.value in PEER_FAILURES, reply
    for room in rig.decode.wait(list(rig.decode.rooms)):
        rig.decode.release(room)
    check_healthy(rig)


def test_a_stopped_decode_does_not_hold_up_the_others(rig: Rig, tmp_path: Path) -> None:
    victim_rooms = {rig.next_room(): 9 + i for i in range(4)}
    child = start_decode_process(rig, victim_rooms, tmp_path)
    child.popen.send_signal(signal.SIGSTOP)
    try:
        victims, normal = send_mixed(rig, victim_rooms)
        served = rig.router.wait(normal, timeout_s=30)  # while the victim is still stopped
        assert all(
            isinstance(r, Result) and r.status is OutcomeStatus.OK for r in served.values()
        ), served
        replies = rig.router.wait(victims, timeout_s=60)
        for reply in replies.values():  # its KV may land in a stopped process's memory
            assert isinstance(reply, Result), reply
            assert reply.status is OutcomeStatus.OK or reply.reason.value in PEER_FAILURES
        for room in rig.decode.wait(list(rig.decode.rooms)):
            rig.decode.release(room)
        rig.procs.append(child)
        check_healthy(rig)
    finally:
        child.popen.send_signal(signal.SIGCONT)
        child.kill()
