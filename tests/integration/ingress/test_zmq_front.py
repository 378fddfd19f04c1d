"""The ingress on a live socket: replies, state rejects, abort, routers, disconnects, CURVE."""

from __future__ import annotations

import asyncio
import queue
import random
from pathlib import Path

import pytest
import zmq
import zmq.auth
from msgspec import UNSET

from prefill_worker.ingress.client import (
    BlockingRouterClient,
    CurveClientKeys,
    RequestRejected,
    RouterClient,
)
from prefill_worker.ingress.messages import (
    Abort,
    Ping,
    Pong,
    Reject,
    RejectCode,
    Result,
    encode,
    prefill_message,
)
from prefill_worker.ingress.zmq_front import (
    CurveServerKeys,
    Ingress,
    IngressError,
    default_max_message_bytes,
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
    SNAPSHOT,
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
    assert plain.first_token_logprob is UNSET
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
    sock.send(encode(prefill_message("dup", [1, 2], 1)))
    sock.send(encode(prefill_message("dup", [3, 4], 2)))
    [reject] = recv_msgs(sock, 1)
    assert isinstance(reject, Reject) and reject.code is RejectCode.DUPLICATE_REQUEST_ID
    assert reject.request_id == "dup"
    wait_until(lambda: worker.engine.release() == 1)
    [result] = recv_msgs(sock, 1)
    assert isinstance(result, Result) and result.first_token_id == 2
    sock.send(encode(prefill_message("dup", [9], 3)))  # answered: the id is free again
    wait_until(lambda: worker.engine.release() == 1)
    [again] = recv_msgs(sock, 1)
    assert isinstance(again, Result) and again.first_token_id == 9


def test_draining(worker: Worker) -> None:
    with BlockingRouterClient(worker.endpoint) as client:
        worker.ingress.set_draining(True)
        with pytest.raises(RequestRejected) as info:
            client.prefill([1], 1)
        assert info.value.code == "draining"
        assert client.ping().draining
        worker.ingress.set_draining(False)
        assert client.prefill([1], 1).status is OutcomeStatus.OK


def test_drain_message_is_forbidden_unless_allowed(worker: Worker) -> None:
    with BlockingRouterClient(worker.endpoint) as client:
        with pytest.raises(RequestRejected) as info:
            client.drain(timeout_s=10)
        assert info.value.code == "forbidden" and "allow_drain_message" in str(info.value)
        assert not worker.ingress.is_draining and not client.ping().draining
        assert client.prefill([1], 1).status is OutcomeStatus.OK
    drains: list[bool] = []
    allowed = start_worker(allow_drain_message=True, on_drain=lambda: drains.append(True))
    try:
        with BlockingRouterClient(allowed.endpoint) as client:
            assert client.drain(timeout_s=10).draining and allowed.ingress.is_draining
        assert drains == [True]
    finally:
        stop_worker(allowed)


def test_overloaded(zctx: Ctx) -> None:
    w = start_worker(max_inflight=2)
    try:
        w.engine.hold = True
        sock = dealer(zctx, w.endpoint)
        for i in range(3):
            sock.send(encode(prefill_message(f"r{i}", [i + 1], i)))
        [reject] = recv_msgs(sock, 1)
        assert isinstance(reject, Reject) and reject.code is RejectCode.OVERLOADED
        assert reject.request_id == "r2"
        wait_until(lambda: w.engine.release() == 2)
        results = [m for m in recv_msgs(sock, 2) if isinstance(m, Result)]
        assert {m.request_id for m in results} == {"r0", "r1"}
    finally:
        stop_worker(w)


def test_abort_is_forwarded_once_answered_once_and_idempotent(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    sock = dealer(zctx, worker.endpoint)
    sock.send(encode(prefill_message("a", [4, 5], 1)))
    wait_until(lambda: worker.engine.holds("a"))
    sock.send(encode(Abort(request_id="a")))
    sock.send(encode(Abort(request_id="a")))
    sock.send(encode(Abort(request_id="never-sent")))
    [result] = recv_msgs(sock, 1)
    assert isinstance(result, Result) and result.status is OutcomeStatus.ABORTED
    assert result.reason is FinishReason.ABORTED_BY_ROUTER
    sock.send(encode(Abort(request_id="a")))  # after the reply: not in flight, not forwarded
    worker.engine.hold = False
    sock.send(encode(prefill_message("b", [6], 2)))
    [after] = recv_msgs(sock, 1)  # the engine is FIFO: any extra reply would come first
    assert isinstance(after, Result) and after.request_id == "b"
    assert worker.engine.num_aborts_seen <= 2


def test_two_routers_get_their_own_replies_only(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True  # replies are sent after both routers sent everything
    socks = [dealer(zctx, worker.endpoint) for _ in range(2)]
    for i in range(200):
        for r, sock in enumerate(socks):
            sock.send(encode(prefill_message(f"router{r}-{i}", [r, i % VOCAB_SAFE], i)))
    wait_until(lambda: len(worker.engine.held) == 400)
    worker.engine.release()
    for r, sock in enumerate(socks):
        got = [m for m in recv_msgs(sock, 200) if isinstance(m, Result)]
        assert sorted(m.request_id for m in got) == sorted(f"router{r}-{i}" for i in range(200))
        assert sock.poll(50) == 0, "a reply meant for the other router"


def test_router_that_disconnects_with_requests_in_flight(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    stays = dealer(zctx, worker.endpoint)
    stays.send(encode(prefill_message("stays", [7], 1)))
    gone = dealer(zctx, worker.endpoint)
    for i in range(300):
        gone.send(encode(prefill_message(f"gone-{i}", [1, 2], i)))
    wait_until(lambda: len(worker.engine.held) == 301)
    gone.close(linger=0)
    # Every request of the closed connection is aborted, and only those.
    wait_until(lambda: list(worker.engine.held) == [k for k in worker.engine.held if "/stays" in k])
    assert worker.engine.holds("stays")
    assert {a.reason for a in worker.engine.aborts} == {FinishReason.ROUTER_GONE}
    wait_until(lambda: worker.ingress.stats().num_unroutable == 300)
    stats = worker.ingress.stats()
    assert (stats.num_routers_gone, stats.num_aborted_router_gone) == (1, 300)
    assert stats.num_inflight == 1
    worker.engine.release()
    [result] = recv_msgs(stays, 1)
    assert isinstance(result, Result) and result.request_id == "stays"
    worker.engine.hold = False
    with BlockingRouterClient(worker.endpoint) as client:
        assert client.prefill([3, 4], 1).first_token_id == 4
        assert client.ping() == LOAD
    assert worker.ingress.is_alive and worker.ingress.error is None


def test_multi_frame_and_oversize_messages_do_not_hurt(worker: Worker, zctx: Ctx) -> None:
    sock = dealer(zctx, worker.endpoint)
    sock.send_multipart([encode(Ping(nonce=1)), encode(Ping(nonce=2))])
    [reject] = recv_msgs(sock, 1)
    assert isinstance(reject, Reject) and reject.code is RejectCode.MALFORMED
    assert worker.ingress.stats().num_malformed == 1
    big = dealer(zctx, worker.endpoint)
    big.send(b"\x00" * (128 * 1024))  # over max_message_bytes: ZMQ drops the connection
    sock.send(encode(Ping(nonce=3)))
    [pong] = recv_msgs(sock, 1)
    assert isinstance(pong, Pong) and pong.nonce == 3


def test_many_requests_in_flight_on_the_async_client(worker: Worker) -> None:
    async def run() -> list[Result]:
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
        lambda: SNAPSHOT,
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
        sock.send(encode(prefill_message("first", [1], 1)))
        sock.send(encode(prefill_message("second", [2], 2)))
        [reject] = recv_msgs(sock, 1)
        assert isinstance(reject, Reject) and reject.code is RejectCode.OVERLOADED
        assert reject.request_id == "second" and ingress.stats().num_inflight == 1
        assert inbox.get_nowait().request_id.endswith("/first")


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
        self.rejects: list[str] = []
        self.malformed = 0

    def on_reject(self, code: str) -> None:
        self.rejects.append(code)

    def on_malformed(self) -> None:
        self.malformed += 1

    def on_unroutable(self) -> None:
        return None


def test_observer_counts_rejects_and_malformed_frames(zctx: Ctx) -> None:
    seen = RecordingObserver()
    w = start_worker(observer=seen)
    try:
        sock = dealer(zctx, w.endpoint)
        sock.send(encode(prefill_message("ok", [1], 1)))
        sock.send(encode(prefill_message("bad", [], 1)))
        sock.send(b"\xc1not msgpack")
        sock.send(encode(Ping(nonce=5)))
        assert len(recv_msgs(sock, 4)) == 4
        assert seen.malformed == 1
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


def test_two_routers_may_use_the_same_request_id(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    first, second = dealer(zctx, worker.endpoint), dealer(zctx, worker.endpoint)
    first.send(encode(prefill_message("same", [1, 11], 1)))
    second.send(encode(prefill_message("same", [2, 22], 2)))
    wait_until(lambda: len(worker.engine.held) == 2)
    first.send(encode(prefill_message("same", [3], 3)))  # a duplicate on its own connection only
    [reject] = recv_msgs(first, 1)
    assert isinstance(reject, Reject) and reject.code is RejectCode.DUPLICATE_REQUEST_ID
    assert "on this connection" in reject.message
    worker.engine.release()
    [a] = recv_msgs(first, 1)
    [b] = recv_msgs(second, 1)
    assert isinstance(a, Result) and (a.request_id, a.first_token_id) == ("same", 11)
    assert isinstance(b, Result) and (b.request_id, b.first_token_id) == ("same", 22)
    assert first.poll(50) == 0 and second.poll(50) == 0


def test_abort_counts_only_from_the_connection_that_sent_the_prefill(
    worker: Worker, zctx: Ctx
) -> None:
    worker.engine.hold = True
    owner, other = dealer(zctx, worker.endpoint), dealer(zctx, worker.endpoint)
    owner.send(encode(prefill_message("mine", [5], 1)))
    wait_until(lambda: worker.engine.holds("mine"))
    other.send(encode(Abort(request_id="mine")))
    other.send(encode(Ping(nonce=1)))  # the ping is answered after the abort was handled
    [pong] = recv_msgs(other, 1)
    assert isinstance(pong, Pong) and worker.engine.num_aborts_seen == 0
    owner.send(encode(Abort(request_id="mine")))
    [result] = recv_msgs(owner, 1)
    assert isinstance(result, Result) and result.status is OutcomeStatus.ABORTED
    assert other.poll(50) == 0


def test_the_decode_peer_named_by_the_router_reaches_the_engine(worker: Worker) -> None:
    with BlockingRouterClient(worker.endpoint) as client:
        assert client.prefill([1, 2], 1, decode_peer="decode-agent-7").status is OutcomeStatus.OK
    assert worker.engine.seen_peers == ["decode-agent-7"]


def test_default_message_limit_fits_the_largest_prompt_and_little_more() -> None:
    assert default_max_message_bytes(8192) == 4 * 8192 + 64 * 1024
    w = start_worker(max_message_bytes=None, max_prompt_tokens=512)
    try:
        with BlockingRouterClient(w.endpoint) as client:
            assert client.prefill([1] * 512, 1).num_prompt_tokens == 512
    finally:
        stop_worker(w)


class FairnessInbox(queue.Queue[PrefillRequest | AbortRequest]):
    """The engine's inbox, which the ingress's I/O thread puts each admitted prefill into. Once
    ``worker`` is set: on the first prefill admitted, releases the held small request; then
    notes, at each admission, how many replies the I/O thread had sent."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: Worker | None = None
        self.sent_at_admission: list[int] = []

    def put_nowait(self, item: PrefillRequest | AbortRequest) -> None:
        if self.worker is not None and isinstance(item, PrefillRequest):
            if not self.sent_at_admission:
                assert self.worker.engine.release(limit=1) == 1
            self.sent_at_admission.append(self.worker.ingress.stats().num_sent)
        super().put_nowait(item)


def test_a_reply_is_not_held_behind_many_big_frames(zctx: Ctx) -> None:
    tokens = 256 * 1024  # 1 MiB frames: one is a whole receive batch
    seen = FairnessInbox()
    w = start_worker(
        seen,
        max_prompt_tokens=tokens,
        max_pool_tokens=tokens,
        max_message_bytes=2 * 1024 * 1024,
    )
    try:
        w.engine.hold = True
        small, big = dealer(zctx, w.endpoint), dealer(zctx, w.endpoint)
        small.send(encode(prefill_message("small", [1, 2], 1)))
        wait_until(lambda: w.engine.holds("small"))
        seen.worker = w
        payload = [3] * tokens
        for i in range(12):
            big.send(encode(prefill_message(f"big-{i}", payload, 100 + i)))
        [result] = recv_msgs(small, 1)
        assert isinstance(result, Result) and result.request_id == "small"
        wait_until(lambda: len(seen.sent_at_admission) == 12)
        # Released at the first big admission; out before the third big frame was decoded.
        assert seen.sent_at_admission[2] >= 1, seen.sent_at_admission
    finally:
        stop_worker(w)


def test_a_second_connection_cannot_take_over_a_routing_id(worker: Worker, zctx: Ctx) -> None:
    worker.engine.hold = True
    owner = zctx.socket(zmq.DEALER)
    owner.setsockopt(zmq.ROUTING_ID, b"router-1")
    owner.setsockopt(zmq.LINGER, 0)
    owner.connect(worker.endpoint)
    owner.send(encode(prefill_message("mine", [5, 6], 1)))
    wait_until(lambda: worker.engine.holds("mine"))
    thief = zctx.socket(zmq.DEALER)
    thief.setsockopt(zmq.ROUTING_ID, b"router-1")
    thief.setsockopt(zmq.LINGER, 0)
    thief.connect(worker.endpoint)
    thief.send(encode(Abort(request_id="mine")))
    owner.send(encode(Ping(nonce=1)))
    [pong] = recv_msgs(owner, 1)
    assert isinstance(pong, Pong) and worker.engine.num_aborts_seen == 0
    worker.engine.release()
    [result] = recv_msgs(owner, 1)
    assert isinstance(result, Result) and result.first_token_id == 6
    assert thief.poll(50) == 0
