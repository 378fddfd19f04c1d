"""Rank 0's relay over a real ZMQ link, a DEALER standing in for rank 1: a request sent before
the rank said it serves waits for it; an abort goes where its request went; each outcome is
handed on once; a failed rank's requests are answered once, with their prompt lengths."""

from __future__ import annotations

import queue
from array import array
from pathlib import Path

import zmq

from prefill_worker.dp import wire
from prefill_worker.dp.relay import Relay
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
)
from tests.polling import wait_until


def request(request_id: str, room: int) -> PrefillRequest:
    return PrefillRequest(request_id, array("i", [1, 2, 3]), SamplingParams(), False, room, 0.0)


def test_the_relay_holds_routes_and_answers_once(tmp_path: Path) -> None:
    outcomes: queue.Queue[Outcome] = queue.Queue()
    relay = Relay(str(tmp_path), 2, outcomes.put)
    rank = zmq.Context.instance().socket(zmq.DEALER)
    rank.setsockopt(zmq.ROUTING_ID, b"1")
    rank.setsockopt(zmq.RCVTIMEO, 5000)
    rank.setsockopt(zmq.LINGER, 0)
    try:
        relay.submit(1, request("early", 1))  # before the rank connected: held
        rank.connect(relay.endpoint)
        rank.send(wire.encode(wire.Ready({"bootstrap": "tcp://127.0.0.1:1"})))
        assert relay.wait_ready(5.0) and relay.endpoints[1]["bootstrap"] == "tcp://127.0.0.1:1"
        got = wire.decode_to_rank(rank.recv())
        assert isinstance(got, wire.Submit) and got.request.request_id == "early"
        relay.submit(1, request("late", 3))
        assert relay.cancel(AbortRequest("late"))
        assert not relay.cancel(AbortRequest("nowhere"))  # rank 0's: not forwarded
        kinds = [type(wire.decode_to_rank(rank.recv())) for _ in range(2)]
        assert kinds == [wire.Submit, wire.Cancel]
        assert relay.num_inflight == 2 and relay.inflight_on(1) == 2
        done = Outcome("early", OutcomeStatus.OK, FinishReason.OK, 3, first_token_id=7)
        rank.send(wire.encode(wire.Done(done)))
        rank.send(wire.encode(wire.Load(LoadSnapshot(num_waiting=1))))
        assert outcomes.get(timeout=5) == done
        wait_until(lambda: relay.loads.get(1) == LoadSnapshot(num_waiting=1), 5.0, "the load")
        relay.fail_inflight(FinishReason.ENGINE_ERROR, "rank 1 failed")
        failed = outcomes.get(timeout=5)
        assert (failed.request_id, failed.reason, failed.num_prompt_tokens) == (
            "late", FinishReason.ENGINE_ERROR, 3,
        )  # fmt: skip
        assert failed.error == "rank 1 failed" and relay.num_inflight == 0
        rank.send(wire.encode(wire.Done(Outcome("late", OutcomeStatus.OK, FinishReason.OK, 3))))
        relay.stop_ranks()
        assert isinstance(wire.decode_to_rank(rank.recv()), wire.Stop)
        assert outcomes.empty()  # the late answer of a failed request is dropped: one each
    finally:
        rank.close()
        relay.close()
