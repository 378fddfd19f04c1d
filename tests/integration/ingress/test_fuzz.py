"""Fuzzing a live ingress: garbage interleaved with good requests; the worker stays up and
answers exactly what the protocol says it must (computed locally with ``decode_router``)."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_worker.ingress.messages import (
    Drain,
    Ping,
    Pong,
    Reject,
    RejectCode,
    Result,
    encode,
    pack_tokens,
    prefill_message,
)
from prefill_worker.ingress.validate import Limits, decode_router
from prefill_worker.request import AbortRequest, OutcomeStatus, SamplingParams
from tests.integration.ingress.conftest import VOCAB, Worker, dealer, recv_msgs

LIMITS = Limits(VOCAB, 512, 1024)
Ctx = zmq.Context[zmq.Socket[bytes]]


def good_frame(i: int, rng: random.Random, prefix: str = "ok") -> bytes:
    tokens = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    sampling = SamplingParams(rng.random(), 0.5 + rng.random() / 2, rng.randrange(5), i)
    return encode(prefill_message(f"{prefix}-{i}", tokens, i, sampling, bool(i % 2)))


def mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:
        del data[rng.randrange(len(data)) :]
    elif kind == 2:
        at = rng.randrange(len(data))
        data[at:at] = rng.randbytes(rng.randrange(1, 8))
    else:
        at = rng.randrange(len(data))
        del data[at : at + rng.randrange(1, 8)]
    return bytes(data)


def garbage(rng: random.Random, i: int) -> bytes:
    if rng.random() < 0.3:
        return rng.randbytes(rng.randrange(0, 120))
    return mutate(good_frame(i, rng, prefix="mut"), rng)


def expected_replies(frames: list[bytes]) -> tuple[int, int]:
    """(replies the worker owes for these frames, how many of them are malformed)."""
    owed = malformed = 0
    for frame in frames:
        msg = decode_router(frame, LIMITS)
        owed += not isinstance(msg, AbortRequest)
        malformed += isinstance(msg, Reject) and msg.code is RejectCode.MALFORMED
    return owed, malformed


def exchange(worker: Worker, sock: zmq.Socket[bytes], frames: list[bytes]) -> list[Any]:
    frames = [f for f in frames if not isinstance(decode_router(f, LIMITS), Drain)]
    owed, malformed = expected_replies(frames)
    before = worker.ingress.stats().num_malformed
    for frame in frames:
        sock.send(frame)
    replies = recv_msgs(sock, owed)
    sock.send(encode(Ping(nonce=424242)))
    [last] = recv_msgs(sock, 1)  # nothing beyond what was owed arrived before it
    assert isinstance(last, Pong) and last.nonce == 424242
    assert worker.ingress.stats().num_malformed - before == malformed
    return replies


def check_good_answered(replies: list[Any], good_ids: set[str]) -> None:
    results = {r.request_id: r for r in replies if isinstance(r, Result)}
    for rid in good_ids:
        assert results[rid].status is OutcomeStatus.OK, rid


def test_ten_thousand_random_and_mutated_frames(worker: Worker, zctx: Ctx) -> None:
    rng = random.Random(20261129)
    sock = dealer(zctx, worker.endpoint)
    num_sent = 0
    for batch in range(10):
        frames, good_ids = [], set()
        for i in range(1000):
            n = batch * 1000 + i
            if i % 10 == 0:
                frames.append(good_frame(n, rng))
                good_ids.add(f"ok-{n}")
            else:
                frames.append(garbage(rng, n))
        num_sent += len(frames)
        check_good_answered(exchange(worker, sock, frames), good_ids)
    assert num_sent >= 10_000
    assert worker.ingress.is_alive and worker.ingress.stats().num_malformed > 1000
    assert worker.ingress.stats().num_inflight == 0


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=48)
)
_values = st.recursive(
    _leaves,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=8,
)
_messages = st.fixed_dictionaries(
    {},
    optional={
        "v": st.just(1) | _values,
        "type": st.sampled_from(["prefill", "abort", "ping", "pong", "result"]) | _values,
        "request_id": st.text(min_size=1, max_size=8).map(lambda s: "hyp-" + s) | _values,
        "token_ids": st.binary(max_size=64) | st.lists(st.integers(0, 2000)).map(pack_tokens),
        "bootstrap_room": st.integers(-5, 2**64 - 1) | _values,
        "sampling": st.dictionaries(
            st.sampled_from(["temperature", "top_p", "top_k", "seed"]),
            st.integers(-3, 3) | st.floats() | _values,
        )
        | _values,
        "return_logprob": st.booleans() | _values,
        "deadline_s": st.floats() | _values,
        "nonce": st.integers(-(2**63), 2**63 - 1) | _values,
    },
).map(lambda m: msgpack.packb(m, use_bin_type=True))
_frames = _messages | _values.map(lambda v: msgpack.packb(v, use_bin_type=True)) | st.binary()


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(garbage_frames=st.lists(_frames, min_size=1, max_size=20), seed=st.integers(0, 2**32))
def test_hypothesis_frames_interleaved_with_good_requests(
    worker: Worker, zctx: Ctx, garbage_frames: list[bytes], seed: int
) -> None:
    rng = random.Random(seed)
    sock = dealer(zctx, worker.endpoint)
    frames, good_ids = [], set()
    for i, junk in enumerate(garbage_frames):
        frames.append(junk)
        rid = f"ok-{seed}-{i}"
        frames.append(encode(prefill_message(rid, [rng.randrange(VOCAB)], i)))
        good_ids.add(rid)
    check_good_answered(exchange(worker, sock, frames), good_ids)
    sock.close(linger=0)
