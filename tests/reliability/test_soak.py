"""The soak: thousands of mixed requests through a real worker process (real ZMQ, real NIXL to a
``KVReceiver`` decode) in waves; every reply checked against its kind, the worker's resident
memory, open fds and threads bounded, and the health check at the end.

The mix per wave: normal requests; router aborts; decode aborts; aborts before any decode
wants the room; deadlines that pass; requests rejected for an empty prompt, a token outside
the vocabulary or bad sampling; malformed frames; and every few waves the router reconnects.
``test_soak_short`` runs in CI (1,000 requests); ``test_soak_10k`` is ``slow``.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from prefill_worker.ingress.messages import Reject, RejectCode, Result
from prefill_worker.request import FinishReason, OutcomeStatus, SamplingParams
from prefill_worker.transfer import RoomState
from tests.checkpoints import prompt
from tests.reliability.conftest import VOCAB_SIZE, ProcStats, Reply, Rig, check_healthy

KINDS = {  # kind: weight
    "normal": 50,
    "normal_want_late": 10,
    "router_abort": 6,
    "decode_abort": 6,
    "abort_unwanted": 5,
    "deadline": 5,
    "reject_empty": 4,
    "reject_token": 4,
    "reject_sampling": 4,
    "malformed": 6,
}
REJECT_CODES = {
    "reject_empty": RejectCode.EMPTY_PROMPT,
    "reject_token": RejectCode.TOKEN_OUT_OF_RANGE,
    "reject_sampling": RejectCode.BAD_SAMPLING,
    "malformed": RejectCode.MALFORMED,
}
WAVE = 16  # requests in flight together (the tiny config runs 8 at once)
RECONNECT_EVERY = 5  # waves
MAX_RSS_GROWTH_KIB = 16 * 1024  # second half over first half, after warm-up
MAX_FD_GROWTH = 2  # ZMQ closes a dropped router's socket asynchronously


@dataclass
class Job:
    kind: str
    room: int | None
    num_tokens: int
    request_id: str | None = None


@dataclass
class SoakReport:
    num_requests: int
    seconds: float
    kinds: Counter[str]
    outcomes: Counter[str]
    stats: list[ProcStats]  # the worker after each wave, all requests of it settled

    def halves(self) -> tuple[list[ProcStats], list[ProcStats]]:
        """Stats of the middle and last third: the first third is warm-up."""
        third = len(self.stats) // 3
        return self.stats[third : 2 * third], self.stats[2 * third :]


def start(rig: Rig, job: Job, rng: random.Random) -> None:
    """Send one job's messages (the decode's want first where it has one)."""
    router, decode = rig.router, rig.decode
    ids = prompt(job.num_tokens, seed=rng.randrange(10_000))
    if job.kind in ("normal", "router_abort", "decode_abort"):
        assert job.room is not None
        decode.want(job.room, job.num_tokens)
    if job.kind == "malformed":
        router.send_frame(rng.choice([b"\x00garbage", b"\xc1" * 64, b"\x93\x01\x02"]), None)
        return
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32))
    deadline_s = None
    if job.kind == "reject_empty":
        ids = []
    elif job.kind == "reject_token":
        ids[rng.randrange(len(ids))] = VOCAB_SIZE + rng.randrange(1000)
    elif job.kind == "reject_sampling":
        sampling = SamplingParams(temperature=rng.choice([-1.0, 101.0]), top_p=0.5)
    elif job.kind == "deadline":
        deadline_s = 1e-4
    room = job.room if job.room is not None else rig.next_room()
    job.request_id = router.send_prefill(ids, room, sampling=sampling, deadline_s=deadline_s)
    if job.kind == "normal_want_late":
        assert job.room is not None
        decode.want(job.room, job.num_tokens)


def after_accepted(rig: Rig, jobs: list[Job]) -> None:
    """Aborts, once the worker holds the wave's prefills (a pong comes after them)."""
    rig.router.ping()
    for job in jobs:
        if job.kind in ("router_abort", "abort_unwanted"):
            assert job.request_id is not None
            rig.router.abort(job.request_id)
        elif job.kind == "decode_abort":
            assert job.room is not None
            rig.decode.abort(job.room)


def check(job: Job, reply: Reply) -> str:
    """Assert the reply fits the job's kind; returns a label for the tally."""
    if job.kind in REJECT_CODES:
        assert isinstance(reply, Reject) and reply.code is REJECT_CODES[job.kind], (job, reply)
        return f"reject:{reply.code.value}"
    assert isinstance(reply, Result), (job, reply)
    allowed = {
        "normal": {FinishReason.OK},
        "normal_want_late": {FinishReason.OK},
        "router_abort": {FinishReason.OK, FinishReason.ABORTED_BY_ROUTER},
        # An abort that overtakes the prefill on its way to the engine finds only the want:
        # it is dropped and acknowledged, and the prefill then waits out its bootstrap timeout.
        "decode_abort": {
            FinishReason.OK,
            FinishReason.ABORTED_BY_DECODE,
            FinishReason.BOOTSTRAP_TIMEOUT,
        },
        "abort_unwanted": {FinishReason.ABORTED_BY_ROUTER},
        "deadline": {FinishReason.DEADLINE_EXCEEDED},
    }[job.kind]
    assert reply.reason in allowed, (job, reply)
    if reply.status is OutcomeStatus.OK:
        assert reply.first_token_id is not None and 0 <= reply.first_token_id < VOCAB_SIZE
    return reply.reason.value


def run_wave(rig: Rig, rng: random.Random, size: int) -> list[str]:
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=size)
    jobs = []
    for kind in kinds:
        wants = kind in ("normal", "normal_want_late", "router_abort", "decode_abort")
        jobs.append(Job(kind, rig.next_room() if wants else None, rng.randint(1, 40)))
    for job in jobs:
        start(rig, job, rng)
    after_accepted(rig, jobs)
    replies = rig.router.wait([j.request_id for j in jobs if j.request_id is not None], 60)
    rig.ledger.wait_answered(60)  # the anonymous rejects of malformed frames too
    labels = []
    for job in jobs:
        if job.request_id is None:  # a malformed frame: its reject can only be anonymous
            labels.append(f"reject:{RejectCode.MALFORMED.value}")
            continue
        reply = replies[job.request_id]
        labels.append(check(job, reply))
        if job.room is not None:
            status = rig.decode.wait([job.room])[job.room]
            ok = isinstance(reply, Result) and reply.status is OutcomeStatus.OK
            if ok and job.kind == "decode_abort":
                # the decode's abort can race the end of the push: sent while the room was
                # still PENDING at the decode (status "done" read, a write's notification
                # not yet), it is acknowledged "aborted" after the worker answered ok
                assert status.state in (RoomState.DONE, RoomState.ABORTED), (job, status)
            else:
                assert (status.state is RoomState.DONE) == ok, (job, reply, status)
            rig.decode.release(job.room)
    return labels


def check_anonymous(rig: Rig) -> None:
    """Every reply without a request id is the ``malformed`` reject of a garbage frame."""
    with rig.ledger.cond:
        anonymous = [r for (_, rid), rs in rig.ledger.replies.items() if rid is None for r in rs]
    assert all(isinstance(r, Reject) and r.code is RejectCode.MALFORMED for r in anonymous)


def soak(rig: Rig, num_requests: int, seed: int) -> SoakReport:
    rng = random.Random(seed)
    pid = rig.worker.proc.pid
    report = SoakReport(num_requests, 0.0, Counter(), Counter(), [])
    started = time.monotonic()
    num_sent, wave = 0, 0
    while num_sent < num_requests:
        size = min(WAVE, num_requests - num_sent)
        report.outcomes.update(run_wave(rig, rng, size))
        num_sent, wave = num_sent + size, wave + 1
        if wave % RECONNECT_EVERY == 0:
            rig.router.reconnect()
            report.kinds["reconnect"] += 1
        report.stats.append(ProcStats.of(pid))
    report.seconds = time.monotonic() - started
    check_anonymous(rig)
    report.kinds.update(k for k in report.outcomes)
    return report


def check_bounded(report: SoakReport) -> dict[str, object]:
    middle, last = report.halves()
    rss_growth = max(s.rss_kib for s in last) - max(s.rss_kib for s in middle)
    fd_growth = max(s.num_fds for s in last) - max(s.num_fds for s in middle)
    measured = {
        "requests": report.num_requests,
        "seconds": round(report.seconds, 1),
        "rss_mib_after_warmup": round(middle[0].rss_kib / 1024, 1),
        "rss_mib_end": round(last[-1].rss_kib / 1024, 1),
        "rss_growth_kib": rss_growth,
        "fds": sorted({s.num_fds for s in middle + last}),
        "threads": sorted({s.num_threads for s in middle + last}),
        "outcomes": dict(report.outcomes),
        "reconnects": report.kinds["reconnect"],
    }
    print("soak:", json.dumps(measured))
    assert rss_growth < MAX_RSS_GROWTH_KIB, measured
    assert fd_growth <= MAX_FD_GROWTH, measured
    assert max(s.num_threads for s in last) <= max(s.num_threads for s in middle), measured
    return measured


def test_soak_short(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory()
    report = soak(rig, 1_000, seed=12)
    assert report.outcomes["ok"] > 400, report.outcomes
    check_bounded(report)
    check_healthy(rig)


@pytest.mark.slow
def test_soak_10k(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory()
    report = soak(rig, 10_000, seed=10_000)
    assert report.outcomes["ok"] > 4_000, report.outcomes
    check_bounded(report)
    check_healthy(rig)
