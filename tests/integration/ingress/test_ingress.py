"""The ingress on a live socket: replies, state rejects, abort, routers, disconnects, CURVE."""

from __future__ import annotations

import asyncio
import queue
import random
from pathlib import Path

import pytest
import zmq
import zmq.auth

from prefill_worker.client import (
    BlockingRouterClient,
    CurveClientKeys,
    RequestRejected,
    RouterClient,
)
from prefill_worker.ingress import CurveServerKeys, Ingress, IngressError
from prefill_worker.protocol import (
    AbortMsg,
    PingMsg,
    PongMsg,
    PrefillMsg,
    Reject,
    RejectCode,
    ResultMsg,
    encode,
)
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
)
from tests.integration.ingress.conftest import (
    LOAD,
    Worker,
    dealer,
    recv_msgs,
    start_worker,
    stop_worker,
    wait_until,
)

Ctx = zmq.Context[zmq.Socket[bytes]]
VOCAB_SAFE = 997


def test_prefill_ping_and_logprob_round_trip(worker: Worker) -> None:
    with BlockingRouterClient(worker.endpoint) as client:
        assert client.ping() == LOAD
        plain = client.prefill([5, 6, 7], 11)
        with_lp = client.prefill([5, 6, 8], 12, return_logprob=True, request_id="lp")
    assert (plain.status, plain.first_token_id, plain.num_prompt_tokens) == (OutcomeStatus.OK, 7, 3)
    assert plain.first_token_logprob is None
    assert (with_lp.request_id, with_lp.first_token_id, with_lp.first_token_logprob) == (
        "lp",
        8,
        -0.5,
    )
    assert worker.ingress.stats().num_admitted == 2


def test_bad_request_gets_a_reject_naming_the_field(worker: Worker) -> None:
    with BlockingRouterClient(worker.endpoint) as client:
        with pytest.raises(RequestRejected) as info:
            client.prefill([1, 5000], 1, request_id="oob")
        assert info.value.code == "token_out_of_range"
        assert info.value.reject.request_id == "oob" and "token_ids[1]" in str(info.value)


def test_duplicate_request_id(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    sock = dealer(zctx, worker.endpoint)
    sock.send(encode(PrefillMsg("dup", [1, 2], 1)))
    sock.send(encode(PrefillMsg("dup", [3, 4], 2)))
    [reject] = recv_msgs(sock, 1)
    assert isinstance(reject, Reject) and reject.code is RejectCode.DUPLICATE_REQUEST_ID
    assert reject.request_id == "dup"
    wait_until(lambda: worker.engine.release() == 1)
    [result] = recv_msgs(sock, 1)
    assert isinstance(result, ResultMsg) and result.first_token_id == 2
    sock.send(encode(PrefillMsg("dup", [9], 3)))  # answered: the id is free again
    wait_until(lambda: worker.engine.release() == 1)
    [again] = recv_msgs(sock, 1)
    assert isinstance(again, ResultMsg) and again.first_token_id == 9


def test_draining(worker: Worker) -> None:
    with BlockingRouterClient(worker.endpoint) as client:
        worker.ingress.set_draining(True)
        with pytest.raises(RequestRejected) as info:
            client.prefill([1], 1)
        assert info.value.code == "draining"
        assert client.ping().draining
        worker.ingress.set_draining(False)
        assert client.prefill([1], 1).status is OutcomeStatus.OK
        assert client.drain().draining and worker.ingress.is_draining


def test_overloaded(zctx: Ctx) -> None:
    w = start_worker(max_inflight=2)
    try:
        w.engine.hold = True
        sock = dealer(zctx, w.endpoint)
        for i in range(3):
            sock.send(encode(PrefillMsg(f"r{i}", [i + 1], i)))
        [reject] = recv_msgs(sock, 1)
        assert isinstance(reject, Reject) and reject.code is RejectCode.OVERLOADED
        assert reject.request_id == "r2"
        wait_until(lambda: w.engine.release() == 2)
        results = [m for m in recv_msgs(sock, 2) if isinstance(m, ResultMsg)]
        assert {m.request_id for m in results} == {"r0", "r1"}
    finally:
        stop_worker(w)


def test_abort_is_forwarded_once_answered_once_and_idempotent(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    sock = dealer(zctx, worker.endpoint)
    sock.send(encode(PrefillMsg("a", [4, 5], 1)))
    wait_until(lambda: "a" in worker.engine.held)
    sock.send(encode(AbortMsg("a")))
    sock.send(encode(AbortMsg("a")))
    sock.send(encode(AbortMsg("never-sent")))
    [result] = recv_msgs(sock, 1)
    assert isinstance(result, ResultMsg) and result.status is OutcomeStatus.ABORTED
    assert result.reason is FinishReason.ABORTED_BY_ROUTER
    sock.send(encode(AbortMsg("a")))  # after the reply: not in flight, not forwarded
    worker.engine.hold = False
    sock.send(encode(PrefillMsg("b", [6], 2)))
    [after] = recv_msgs(sock, 1)  # the engine is FIFO: any extra reply would come first
    assert isinstance(after, ResultMsg) and after.request_id == "b"
    assert worker.engine.num_aborts_seen <= 2


def test_two_routers_get_their_own_replies_only(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True  # replies are sent after both routers sent everything
    socks = [dealer(zctx, worker.endpoint) for _ in range(2)]
    for i in range(200):
        for r, sock in enumerate(socks):
            sock.send(encode(PrefillMsg(f"router{r}-{i}", [r, i % VOCAB_SAFE], i)))
    wait_until(lambda: len(worker.engine.held) == 400)
    worker.engine.release()
    for r, sock in enumerate(socks):
        got = [m for m in recv_msgs(sock, 200) if isinstance(m, ResultMsg)]
        assert sorted(m.request_id for m in got) == sorted(f"router{r}-{i}" for i in range(200))
        assert sock.poll(50) == 0, "a reply meant for the other router"


def test_router_that_disconnects_with_requests_in_flight(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    gone = dealer(zctx, worker.endpoint)
    for i in range(300):
        gone.send(encode(PrefillMsg(f"gone-{i}", [1, 2], i)))
    wait_until(lambda: len(worker.engine.held) == 300)
    gone.close(linger=0)

    def released_until_unroutable() -> bool:
        worker.engine.release(limit=1)
        return worker.ingress.stats().num_unroutable > 0 or not worker.engine.held

    wait_until(released_until_unroutable)
    worker.engine.release()
    wait_until(lambda: worker.ingress.stats().num_inflight == 0)
    assert worker.ingress.stats().num_unroutable > 0
    worker.engine.hold = False
    with BlockingRouterClient(worker.endpoint) as client:
        assert client.prefill([3, 4], 1).first_token_id == 4
        assert client.ping() == LOAD
    assert worker.ingress.is_alive and worker.ingress.error is None


def test_multi_frame_and_oversize_messages_do_not_hurt(worker: Worker, zctx: Ctx) -> None:
    sock = dealer(zctx, worker.endpoint)
    sock.send_multipart([encode(PingMsg(1)), encode(PingMsg(2))])
    [reject] = recv_msgs(sock, 1)
    assert isinstance(reject, Reject) and reject.code is RejectCode.MALFORMED
    assert worker.ingress.stats().num_malformed == 1
    big = dealer(zctx, worker.endpoint)
    big.send(b"\x00" * (128 * 1024))  # over max_message_bytes: ZMQ drops the connection
    sock.send(encode(PingMsg(3)))
    [pong] = recv_msgs(sock, 1)
    assert isinstance(pong, PongMsg) and pong.nonce == 3


def test_many_requests_in_flight_on_the_async_client(worker: Worker) -> None:
    async def run() -> list[ResultMsg]:
        async with RouterClient(worker.endpoint) as client:
            rng = random.Random(1)
            prompts = [[rng.randrange(VOCAB_SAFE) for _ in range(1 + i % 7)] for i in range(300)]
            results = await asyncio.gather(*(client.prefill(p, i) for i, p in enumerate(prompts)))
            assert [r.first_token_id for r in results] == [p[-1] for p in prompts]
            return list(results)

    assert len(asyncio.run(run())) == 300


def bare_ingress(endpoint: str, inbox: queue.Queue[PrefillRequest | AbortRequest]) -> Ingress:
    return Ingress(
        endpoint,
        inbox,
        lambda: LOAD,
        vocab_size=10,
        max_prompt_tokens=10,
        max_pool_tokens=10,
        max_inflight=10,
    )


def test_bind_failure_is_an_ingress_error(worker: Worker) -> None:
    ingress = bare_ingress(worker.endpoint, queue.Queue())
    with pytest.raises(IngressError, match="cannot bind"):
        ingress.start()
    ingress.close()


def test_overloaded_when_the_engine_queue_is_full(zctx: Ctx) -> None:
    inbox: queue.Queue[PrefillRequest | AbortRequest] = queue.Queue(maxsize=1)
    with bare_ingress("tcp://127.0.0.1:0", inbox) as ingress:
        sock = dealer(zctx, ingress.endpoint)
        sock.send(encode(PrefillMsg("first", [1], 1)))
        sock.send(encode(PrefillMsg("second", [2], 2)))
        [reject] = recv_msgs(sock, 1)
        assert isinstance(reject, Reject) and reject.code is RejectCode.OVERLOADED
        assert reject.request_id == "second" and ingress.stats().num_inflight == 1
        assert inbox.get_nowait().request_id == "first"


def test_curve_authorized_client_works_and_unauthorized_gets_nothing(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "client.key").write_bytes(Path(client_public).read_bytes())
    w = start_worker(curve=CurveServerKeys.from_files(server_secret, str(allowed)))
    try:
        good = CurveClientKeys.from_files(client_secret, server_public)
        with BlockingRouterClient(w.endpoint, curve=good) as client:
            assert client.ping(timeout_s=10) == LOAD
            assert client.prefill([1, 2], 1).first_token_id == 2
        bad = CurveClientKeys.from_files(stranger_secret, server_public)
        with BlockingRouterClient(w.endpoint, curve=bad) as stranger, pytest.raises(TimeoutError):
            stranger.ping(timeout_s=0.5)
        with BlockingRouterClient(w.endpoint) as plain, pytest.raises(TimeoutError):
            plain.ping(timeout_s=0.3)
        assert w.ingress.stats().num_admitted == 1
    finally:
        stop_worker(w)


class RecordingObserver:
    def __init__(self) -> None:
        self.requests = 0
        self.rejects: list[str] = []
        self.malformed = 0

    def on_request(self) -> None:
        self.requests += 1

    def on_reject(self, code: str) -> None:
        self.rejects.append(code)

    def on_malformed(self) -> None:
        self.malformed += 1


def test_observer_counts_requests_rejects_and_malformed_frames(zctx: Ctx) -> None:
    seen = RecordingObserver()
    w = start_worker(observer=seen)
    try:
        sock = dealer(zctx, w.endpoint)
        sock.send(encode(PrefillMsg("ok", [1], 1)))
        sock.send(encode(PrefillMsg("bad", [], 1)))
        sock.send(b"\xc1not msgpack")
        sock.send(encode(PingMsg(5)))
        assert len(recv_msgs(sock, 4)) == 4
        assert (seen.requests, seen.malformed) == (1, 1)
        assert sorted(seen.rejects) == ["empty_prompt", "malformed"]
        stats = w.ingress.stats()
        assert (stats.num_admitted, stats.num_rejected, stats.num_malformed) == (1, 2, 1)
    finally:
        stop_worker(w)


def test_outcome_after_close_is_dropped_without_error() -> None:
    w = start_worker()
    stop_worker(w)
    w.ingress.send_outcome(Outcome("late", OutcomeStatus.OK, FinishReason.OK, 1))
    assert not w.ingress.is_alive and w.ingress.error is None
