"""Router-edge scenarios on a real worker process (issue #12): request ids scoped per router
connection, aborts only from the owner, a router that disconnects mid-flight, the `drain`
message and `POST /drain` refused unless enabled, frames far over the limit, and HTTP clients
that reset their connection."""

from __future__ import annotations

import socket
import struct
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefill_worker.ingress.messages import (
    Drain,
    Reject,
    RejectCode,
    Result,
    encode,
    prefill_message,
)
from prefill_worker.request import OutcomeStatus
from tests.checkpoints import prompt
from tests.patience import patient
from tests.polling import wait_until
from tests.reliability.conftest import SharedWorker
from tests.reliability.harness import VOCAB_SIZE, Rig, check_healthy

MAX_PROMPT_TOKENS = 512  # configs/tiny-test.yaml
ROUTER_GONE = {"status": "aborted", "reason": "router_gone"}


@pytest.fixture(scope="module")
def shared_worker(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[SharedWorker]:
    """The module's worker, whose requests no decode wants wait 120 s (tiny-test's 5 s) for
    one: the scenarios end them (a disconnect, an abort) and prove that, not the timeout, so
    none may need to happen before a timer fires on a slow machine."""
    workdir = tmp_path_factory.mktemp("router-worker")
    shared = SharedWorker(workdir, checkpoint, "scheduler.bootstrap_timeout_s=120")
    yield shared
    shared.close()


def test_two_routers_may_use_the_same_request_id(rig: Rig) -> None:
    other = rig.new_router()
    rooms = [rig.next_room(), rig.next_room()]
    rig.decode.want(rooms[0], 9)
    rig.decode.want(rooms[1], 14)
    rig.router.send_prefill(prompt(9, seed=1), rooms[0], request_id="same")
    other.send_prefill(prompt(14, seed=2), rooms[1], request_id="same")
    mine, theirs = rig.router.wait(["same"])["same"], other.wait(["same"])["same"]
    assert isinstance(mine, Result) and mine.status is OutcomeStatus.OK, mine
    assert isinstance(theirs, Result) and theirs.status is OutcomeStatus.OK, theirs
    assert (mine.num_prompt_tokens, theirs.num_prompt_tokens) == (9, 14)
    for room, status in rig.decode.wait(rooms).items():
        assert status.state.value == "done", status
        rig.decode.release(room)
    check_healthy(rig)


def test_abort_of_another_routers_id_has_no_effect(rig: Rig) -> None:
    other = rig.new_router()
    room = rig.next_room()
    rig.router.send_prefill(prompt(9, seed=3), room, request_id="victim")  # waits for its want
    other.abort("victim")
    other.ping()  # the abort was read (and ignored) before this pong was sent
    rig.decode.want(room, 9)
    reply = rig.router.wait(["victim"])["victim"]
    assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
    assert rig.decode.wait([room])[room].state.value == "done"
    rig.decode.release(room)
    own = rig.next_room()
    rig.router.send_prefill(prompt(9, seed=4), own, request_id="mine")  # no want: it waits
    rig.router.abort("mine")
    aborted = rig.router.wait(["mine"])["mine"]
    assert isinstance(aborted, Result) and aborted.status is OutcomeStatus.ABORTED, aborted
    check_healthy(rig)


def test_a_router_that_disconnects_has_its_requests_cancelled(rig: Rig) -> None:
    before = rig.metric("prefill_worker_requests_total", ROUTER_GONE)
    dropped = rig.metric("prefill_worker_unroutable_replies_total")
    leaving = rig.new_router()
    rooms = [rig.next_room() for _ in range(6)]
    for room in rooms:  # no want: they wait for a decode peer (120 s here)
        leaving.send_prefill(prompt(20, seed=room % 100), room)
    wait_until(lambda: leaving.ping().waiting == len(rooms), 10, "requests admitted")
    leaving.reconnect()  # closes the connection mid-flight (its ledger entries are abandoned)
    wait_until(
        lambda: rig.metric("prefill_worker_requests_total", ROUTER_GONE) == before + len(rooms),
        10,
        "router_gone aborts",
    )
    wait_until(
        lambda: rig.metric("prefill_worker_unroutable_replies_total") == dropped + len(rooms),
        10,
        "replies dropped",
    )
    assert leaving.ping().waiting == 0  # the new connection is served
    check_healthy(rig)  # pools whole: every page and aux row came back


def test_drain_message_and_unauthenticated_http_drain_are_refused(rig: Rig) -> None:
    rig.router.send_frame(encode(Drain(nonce=77)), None)
    key = (rig.router.conn, None)
    wait_until(lambda: key in rig.ledger.replies, 10, "the drain reply")
    [reply] = rig.ledger.replies[key]
    assert isinstance(reply, Reject) and reply.code is RejectCode.FORBIDDEN, reply
    assert reply.nonce == 77
    status, body = rig.worker.http("/drain", "POST")
    assert status == 403 and "admin_token_file" in body
    assert rig.worker.http("/readyz")[0] == 200
    assert not rig.router.ping().draining
    check_healthy(rig)


def test_http_drain_with_the_admin_token(rig_factory: Callable[..., Rig], tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("reliability-token\n")
    rig = rig_factory(f"metrics.admin_token_file={token_file}")
    assert post_drain(rig, None) == 403
    assert post_drain(rig, "Bearer not-the-token") == 403
    check_healthy(rig)
    assert post_drain(rig, "Bearer reliability-token") == 202
    assert rig.worker.wait_exit(30) == 0  # drained, then a clean exit


def test_frames_far_over_the_limit_cost_no_decoding(rig: Rig) -> None:
    rejects_before = rejects(rig)
    flooder = rig.new_router()
    for _ in range(3):  # as in the issue: just under 16 MiB each
        flooder.send_frame(b"\x00" * (16 * 1024 * 1024 - 64), None, num_replies=0)
    largest_valid = [1] * (MAX_PROMPT_TOKENS - 1) + [VOCAB_SIZE]  # out of range at the very end
    big_ids = [flooder.send_prefill(largest_valid, rig.next_room()) for _ in range(10)]
    room = rig.next_room()
    rig.decode.want(room, 9)
    small = rig.router.prefill(prompt(9, seed=5), room)
    assert isinstance(small, Result) and small.status is OutcomeStatus.OK, small
    replies = flooder.wait(big_ids)
    assert all(
        isinstance(r, Reject) and r.code is RejectCode.TOKEN_OUT_OF_RANGE for r in replies.values()
    ), replies
    # The 16 MiB frames were dropped by ZMQ before any decoding: only the 10 rejects counted.
    assert rejects(rig) == rejects_before + 10
    rig.decode.release(room)
    check_healthy(rig)


def test_http_clients_that_reset_leave_no_traceback(rig: Rig) -> None:
    for partial in (b"GET /metr", b"POST /drain HTTP/1.1\r\n", b"GET /metrics HTTP/1.1\r\n\r\n"):
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", rig.worker.http_port))
            sock.sendall(partial)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # RST
    assert rig.worker.http("/livez")[0] == 200
    check_healthy(rig)
    assert "Traceback" not in rig.worker.log()


def rejects(rig: Rig) -> float:
    return sum(rig.metric("prefill_worker_rejects_total", {"code": c.value}) for c in RejectCode)


def post_drain(rig: Rig, authorization: str | None) -> int:
    url = f"http://127.0.0.1:{rig.worker.http_port}/drain"
    request = urllib.request.Request(url, method="POST")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=patient(5)) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_room_bound_to_a_named_decode_peer(rig: Rig) -> None:
    # The router names the decode that may claim the room: that decode is served as usual.
    room = rig.next_room()
    rig.decode.want(room, 10)
    name = rig.decode.receiver.agent_name
    rid = "named-peer"
    msg = prefill_message(rid, prompt(10, seed=6), room, decode_peer=name)
    rig.router.send_frame(encode(msg), rid)
    reply = rig.router.wait([rid])[rid]
    assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
    assert rig.decode.wait([room])[room].state.value == "done"
    rig.decode.release(room)
    check_healthy(rig)


def test_a_room_bound_to_another_decode_peer_is_not_claimed(rig: Rig) -> None:
    room = rig.next_room()
    rid = "bound-elsewhere"
    msg = prefill_message(rid, prompt(10, seed=7), room, decode_peer="decode-that-is-not-here")
    rig.router.send_frame(encode(msg), rid)
    rig.router.ping()  # the prefill is on its way to the engine (either order is checked)
    rig.decode.want(room, 10)
    status = rig.decode.wait([room])[room]
    assert status.state.value == "failed", status  # refused: not this decode's room
    rig.decode.release(room)
    rig.router.abort(rid)  # the router gives up on it (else: bootstrap_timeout, 120 s)
    reply = rig.router.wait([rid])[rid]
    assert isinstance(reply, Result) and reply.status is OutcomeStatus.ABORTED, reply
    check_healthy(rig)
