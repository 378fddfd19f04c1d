"""A live ingress on 127.0.0.1 with a fake engine thread that answers through send_outcome."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from prefill_worker.ingress.messages import Load, WorkerMessage, decode_worker
from prefill_worker.ingress.zmq_front import Ingress
from prefill_worker.load import CostSignals, LoadSnapshot
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
)
from tests.polling import wait_until

__all__ = ["wait_until"]  # re-exported for the ingress tests

VOCAB = 1000
# The engine's snapshot the fake engine reports, and the pong a router reads for it.
COSTS = CostSignals(
    120,
    30,
    prefill_rate_tps=1000.0,
    handshake_s=0.01,
    transfer_s=0.002,
    forward_s=0.01,
    arrival_tps=50.0,
    chunk_size=512,
    max_batch_tokens=2048,
)
SNAPSHOT = LoadSnapshot(
    num_bootstrapping=1,
    num_waiting=2,
    num_prefilling=1,
    num_transferring=1,
    num_free_pages=100,
    costs=COSTS,
)
LOAD = Load(
    waiting=3,
    running=2,
    free_kv_pages=100,
    draining=False,
    queued_tokens=120,
    running_tokens=30,
    prefill_rate_tps=1000.0,
    backlog_s=0.16,  # one forward's fixed 0.01 s and 150 tokens at 1000/s
    handshake_s=0.01,
    transfer_s=0.002,
    forward_s=0.01,
    arrival_tps=50.0,
    chunk_size=512,
    max_batch_tokens=2048,
)


class FakeEngine:
    """Consumes the inbox. ``hold`` keeps prefills until ``release``; abort answers ``aborted``.

    The first token is the prompt's last token, so a reply proves which prompt it belongs to.
    ``held`` is keyed by the engine-side id, ``"<routing id hex>/<router's id>"``.
    """

    def __init__(self, inbox: queue.Queue[PrefillRequest | AbortRequest]) -> None:
        self.inbox = inbox
        self.hold = False
        self.held: dict[str, PrefillRequest] = {}
        self.lock = threading.Lock()
        self.ingress: Ingress | None = None
        self.num_aborts_seen = 0
        self.aborts: list[AbortRequest] = []
        self.seen_peers: list[str | None] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, ingress: Ingress) -> None:
        self.ingress = ingress
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(AbortRequest("__stop__"))
        self._thread.join(5)

    def holds(self, router_request_id: str) -> bool:
        """A request the router sent as ``router_request_id`` is held (from any router)."""
        with self.lock:
            return any(key.endswith("/" + router_request_id) for key in self.held)

    def release(self, limit: int | None = None) -> int:
        with self.lock:
            ids = list(self.held)[:limit]
            reqs = [self.held.pop(rid) for rid in ids]
        for req in reqs:
            self._reply(req, OutcomeStatus.OK, FinishReason.OK)
        return len(reqs)

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if isinstance(item, AbortRequest):
                if item.request_id == "__stop__":
                    return
                self.num_aborts_seen += 1
                self.aborts.append(item)
                with self.lock:
                    req = self.held.pop(item.request_id, None)
                if req is not None:
                    self._reply(req, OutcomeStatus.ABORTED, item.reason)
                continue
            self.seen_peers.append(item.decode_peer)
            if self.hold:
                with self.lock:
                    self.held[item.request_id] = item
            else:
                self._reply(item, OutcomeStatus.OK, FinishReason.OK)

    def _reply(self, req: PrefillRequest, status: OutcomeStatus, reason: FinishReason) -> None:
        assert self.ingress is not None
        self.ingress.send_outcome(
            Outcome(
                req.request_id,
                status,
                reason,
                num_prompt_tokens=len(req.token_ids),
                first_token_id=req.token_ids[-1],
                first_token_logprob=-0.5 if req.return_logprob else None,  # the engine's rule
            )
        )


@dataclass
class Worker:
    ingress: Ingress
    engine: FakeEngine
    endpoint: str


def start_worker(
    inbox: queue.Queue[PrefillRequest | AbortRequest] | None = None, **kwargs: object
) -> Worker:
    """``inbox``: the engine's queue the ingress admits into (a test's own, to watch it)."""
    inbox = queue.Queue() if inbox is None else inbox
    engine = FakeEngine(inbox)
    options: dict[str, object] = {
        "vocab_size": VOCAB,
        "max_prompt_tokens": 512,
        "max_pool_tokens": 1024,
        "max_inflight": 10_000,
        "max_message_bytes": 64 * 1024,
    }
    options.update(kwargs)
    ingress = Ingress("tcp://127.0.0.1:0", inbox, lambda: SNAPSHOT, **options)  # type: ignore[arg-type]
    endpoint = ingress.start()
    engine.start(ingress)
    return Worker(ingress, engine, endpoint)


def stop_worker(worker: Worker) -> None:
    worker.engine.stop()
    worker.ingress.close()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = start_worker()
    yield w
    assert w.ingress.error is None
    stop_worker(w)


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    return sock


def recv_msgs(sock: zmq.Socket[bytes], count: int, timeout_s: float = 10.0) -> list[WorkerMessage]:
    """Exactly ``count`` replies, or fail after ``timeout_s``."""
    got: list[WorkerMessage] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and sock.poll(left_ms), f"got {len(got)} of {count} replies"
        got.append(decode_worker(sock.recv()))
    return got
