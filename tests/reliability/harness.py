"""The reliability harness's parts: a ledger of requests and replies, a router, a decode
peer, the rig that holds them, the health check and /proc readings. The fixtures that build
them, and how a scenario uses them, are in ``conftest.py`` (which re-exports all of this)."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from prometheus_client.parser import text_string_to_metric_families

from prefill_worker.ingress.messages import (
    Abort,
    Load,
    Ping,
    Pong,
    ProtocolError,
    Reject,
    Result,
    decode_worker,
    encode,
    prefill_message,
)
from prefill_worker.request import OutcomeStatus, SamplingParams
from prefill_worker.testing.launch import ChildProcess
from prefill_worker.transfer import RoomState, RoomStatus
from tests.checkpoints import COMMON, prompt
from tests.integration.daemon.conftest import DECODE_PAGES, PAGE_SIZE, Decode, Worker
from tests.patience import patient
from tests.polling import wait_until

Reply = Result | Reject
VOCAB_SIZE = int(COMMON["vocab_size"])
DECODE_AUX_ROWS = 64  # tests/integration/daemon Decode
_GREEDY = SamplingParams()
_ROOMS = itertools.count(1_000_000)
_CONNECTIONS = itertools.count(1)
_REQUEST_IDS = itertools.count(1)

# ── the ledger ───────────────────────────────────────────────────────────────────────────────


@dataclass
class Ledger:
    """What was sent and what came back, per (connection, request_id).

    ``expected[key]`` counts the replies a key is owed (a prefill: 1; a second prefill under the
    same id: one more, its ``duplicate_request_id`` reject). ``request_id`` None is the key of
    frames the worker can only answer with an anonymous reject.
    """

    expected: Counter[tuple[int, str | None]] = field(default_factory=Counter)
    replies: dict[tuple[int, str | None], list[Reply]] = field(default_factory=dict)
    abandoned: set[tuple[int, str | None]] = field(default_factory=set)
    unreadable: list[str] = field(default_factory=list)  # replies the protocol cannot decode
    cond: threading.Condition = field(default_factory=threading.Condition)

    def expect(self, conn: int, request_id: str | None, num_replies: int = 1) -> None:
        with self.cond:
            self.expected[(conn, request_id)] += num_replies

    def record(self, conn: int, reply: Reply) -> None:
        with self.cond:
            rid = reply.request_id if isinstance(reply.request_id, str) else None
            self.replies.setdefault((conn, rid), []).append(reply)
            self.cond.notify_all()

    def abandon(self, conn: int) -> None:
        """The connection closed: its unanswered requests can no longer be answered to us."""
        with self.cond:
            for key in self.expected:
                if key[0] == conn and len(self.replies.get(key, ())) < self.expected[key]:
                    self.abandoned.add(key)

    def unanswered(self) -> list[tuple[int, str | None]]:
        with self.cond:
            return [
                key
                for key, num in self.expected.items()
                if key not in self.abandoned and len(self.replies.get(key, ())) < num
            ]

    def wait_answered(self, timeout_s: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: not self.unanswered(), patient(timeout_s)):
                missing = self.unanswered()
                raise AssertionError(f"{len(missing)} requests unanswered: {missing[:10]}")

    def check_exactly_one(self) -> None:
        """No key got more replies than it was owed; no reply for a key nobody sent."""
        with self.cond:
            extra = {
                key: replies
                for key, replies in self.replies.items()
                if len(replies) > self.expected.get(key, 0)
            }
        assert not extra, f"replies beyond one per request: {list(extra.items())[:5]}"
        assert not self.unreadable, f"unreadable replies: {self.unreadable[:5]}"

    @property
    def num_requests(self) -> int:
        return sum(self.expected.values())


# ── a router ─────────────────────────────────────────────────────────────────────────────────


class Router:
    """One DEALER connection to the worker's ingress, every reply recorded in the ledger.

    Sends never block; ``wait`` blocks for replies; a pump thread receives. Thread-safe.
    """

    def __init__(self, endpoint: str, ledger: Ledger) -> None:
        self.endpoint, self.ledger = endpoint, ledger
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._pongs: dict[int, Load] = {}
        self._nonces = itertools.count(1)
        self._sock = self._connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="rig-router", daemon=True)
        self._thread.start()

    def send_prefill(
        self,
        token_ids: Sequence[int],
        room: int,
        *,
        sampling: SamplingParams = _GREEDY,
        return_logprob: bool = False,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> str:
        """Send one ``prefill`` (the ledger expects one reply); returns its request id."""
        rid = request_id if request_id is not None else f"rig-{next(_REQUEST_IDS)}"
        msg = prefill_message(rid, token_ids, room, sampling, return_logprob, deadline_s)
        self.send_frame(encode(msg), rid)
        return rid

    def send_frame(self, frame: bytes, request_id: str | None, num_replies: int = 1) -> None:
        """Any frame (a malformed one too); the ledger expects ``num_replies`` for the id."""
        with self._lock:
            if num_replies:
                self.ledger.expect(self.conn, request_id, num_replies)
            self._sock.send(frame)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._sock.send(encode(Abort(request_id=request_id)))

    def prefill(self, token_ids: Sequence[int], room: int, **kwargs: Any) -> Reply:
        """``send_prefill`` and wait for its reply (30 s)."""
        rid = self.send_prefill(token_ids, room, **kwargs)
        return self.wait([rid])[rid]

    def wait(self, request_ids: Sequence[str], timeout_s: float = 30.0) -> dict[str, Reply]:
        """The first reply of each id sent on this connection."""
        conn, ledger = self.conn, self.ledger
        keys = [(conn, rid) for rid in request_ids]
        with ledger.cond:
            replied = ledger.cond.wait_for(
                lambda: all(k in ledger.replies for k in keys), patient(timeout_s)
            )
            if not replied:
                missing = [k[1] for k in keys if k not in ledger.replies]
                raise AssertionError(f"no reply in {patient(timeout_s)} s for {missing[:10]}")
            return {k[1]: ledger.replies[k][0] for k in keys if k[1] is not None}

    def ping(self, timeout_s: float = 10.0) -> Load:
        with self._lock:
            nonce = next(self._nonces)
            self._sock.send(encode(Ping(nonce=nonce)))
        with self.ledger.cond:
            if not self.ledger.cond.wait_for(lambda: nonce in self._pongs, patient(timeout_s)):
                raise AssertionError(f"no pong in {patient(timeout_s)} s")
            return self._pongs.pop(nonce)

    def reconnect(self) -> None:
        """A new connection (new routing id); what the old one still owed is abandoned."""
        with self._lock:
            self._sock.close(linger=0)
            self.ledger.abandon(self.conn)
            self._sock = self._connect()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._sock.close(linger=0)
            self.ledger.abandon(self.conn)
        self._ctx.term()

    def _connect(self) -> zmq.Socket[bytes]:
        self.conn = next(_CONNECTIONS)
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.endpoint)
        return sock

    def _pump(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                conn, frames = self.conn, []
                while self._sock.poll(0):
                    frames.append(self._sock.recv())
            for frame in frames:
                self._dispatch(conn, frame)
            if not frames:
                self._stop.wait(0.001)  # pacing of an idle pump, not synchronisation

    def _dispatch(self, conn: int, frame: bytes) -> None:
        try:
            msg = decode_worker(frame)
        except ProtocolError as exc:
            with self.ledger.cond:
                self.ledger.unreadable.append(f"{exc}: {frame[:64]!r}")
            return
        if isinstance(msg, Pong):
            with self.ledger.cond:
                self._pongs[msg.nonce or 0] = msg.load
                self.ledger.cond.notify_all()
        else:
            self.ledger.record(conn, msg)


# ── a decode peer ────────────────────────────────────────────────────────────────────────────


class LiveDecode(Decode):
    """The daemon tests' ``Decode`` with recycled pages and aux slots and a pump thread that
    keeps its heartbeats and NIXL notifications flowing. Thread-safe."""

    def __init__(self, bootstrap: str, peer_timeout_s: float = 10.0) -> None:
        super().__init__(bootstrap, peer_timeout_s)
        self._free_pages = list(range(DECODE_PAGES))
        self._free_slots = list(range(DECODE_AUX_ROWS))
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="rig-decode", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def want(self, room: int, num_tokens: int, num_cached_tokens: int = 0) -> None:
        count = -(-num_tokens // PAGE_SIZE)
        with self._lock:
            assert len(self._free_pages) >= count, "the decode pool is exhausted: release rooms"
            pages = [self._free_pages.pop() for _ in range(count)]  # descending, scattered later
            slot = self._free_slots.pop()
            self.rooms[room] = (pages, slot)
            self.receiver.want(room, pages, slot, num_cached_tokens)

    def abort(self, room: int) -> None:
        with self._lock:
            self.receiver.abort(room)

    def status(self, room: int) -> RoomStatus:
        with self._lock:
            return self.receiver.poll(room)

    def wait(self, rooms: Sequence[int], timeout_s: float = 30.0) -> dict[int, RoomStatus]:
        def settled() -> bool:
            return all(self.status(r).state is not RoomState.PENDING for r in rooms)

        wait_until(settled, timeout_s, f"decode rooms {list(rooms)[:10]}")
        return {room: self.status(room) for room in rooms}

    def release(self, room: int) -> None:
        """Forget a settled room and take its pages and aux slot back."""
        with self._lock:
            self.receiver.forget(room)
            pages, slot = self.rooms.pop(room)
            self._free_pages.extend(pages)
            self._free_slots.append(slot)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        super().close()

    def _pump(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.receiver.progress()
            self._stop.wait(0.002)  # pacing of the pump, not synchronisation


# ── the rig ──────────────────────────────────────────────────────────────────────────────────


@dataclass
class Rig:
    worker: Worker
    decode: LiveDecode
    router: Router
    ledger: Ledger
    routers: list[Router] = field(default_factory=list)
    procs: list[ChildProcess] = field(default_factory=list)
    num_health_checks: int = 0

    def next_room(self) -> int:
        return next(_ROOMS)

    def new_router(self) -> Router:
        self.routers.append(Router(self.worker.ingress, self.ledger))
        return self.routers[-1]

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return scrape(self.worker).get((name, tuple(sorted((labels or {}).items()))), 0.0)

    def close_routers(self) -> None:
        for router in [self.router, *self.routers]:
            router.close()


def scrape(worker: Worker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    status, text = worker.http("/metrics")
    assert status == 200, f"/metrics answered {status}"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def pool_usage(worker: Worker) -> dict[str, float]:
    """KV pages and aux rows held, and live requests, as /metrics reports them."""
    samples = scrape(worker)
    live = sum(v for (name, _), v in samples.items() if name == "prefill_worker_queue_requests")
    return {
        "kv_pages_used": samples[("prefill_worker_kv_pages_used", ())],
        "aux_rows_used": samples[("prefill_worker_aux_rows_used", ())],
        "live_requests": live,
    }


def serve_fresh(rig: Rig, num_tokens: int = 9, timeout_s: float = 30.0) -> Result:
    """One new request end to end: decode wants, router prefills, result ok, room DONE."""
    room = rig.next_room()
    rig.decode.want(room, num_tokens)
    reply = rig.router.prefill(prompt(num_tokens, seed=room % 10_000), room)
    assert isinstance(reply, Result), f"fresh request rejected: {reply}"
    assert reply.status is OutcomeStatus.OK, f"fresh request failed: {reply}"
    assert reply.first_token_id is not None and 0 <= reply.first_token_id < VOCAB_SIZE
    status = rig.decode.wait([room], timeout_s)[room]
    assert status.state is RoomState.DONE, f"fresh request's room: {status}"
    rig.decode.release(room)
    return reply


def check_healthy(rig: Rig, timeout_s: float = 30.0) -> None:
    """The end of every scenario: see the module docstring."""
    rig.num_health_checks += 1
    worker = rig.worker
    assert worker.proc.poll() is None, f"worker exited {worker.proc.returncode}\n{worker.log()}"
    rig.ledger.wait_answered(timeout_s)
    serve_fresh(rig)
    usage: dict[str, float] = {}

    def pools_whole() -> bool:
        usage.update(pool_usage(worker))
        return not any(usage.values())

    try:
        wait_until(pools_whole, timeout_s, "pools whole")
    except AssertionError:
        raise AssertionError(f"pools not whole: {usage}\n{worker.log()}") from None
    rig.ledger.check_exactly_one()
    assert worker.proc.poll() is None, f"worker exited {worker.proc.returncode}\n{worker.log()}"
    assert rig.decode.is_alive, "the decode pump thread died"
    assert all(r.is_alive for r in [rig.router, *rig.routers]), "a router pump thread died"
    for proc in rig.procs:
        assert proc.popen.poll() is None, f"{proc.name} exited {proc.popen.returncode}"


# ── the worker process from outside ──────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class ProcStats:
    """What the kernel says about a process: resident memory, open fds, threads."""

    rss_kib: int
    num_fds: int
    num_threads: int

    @classmethod
    def of(cls, pid: int) -> ProcStats:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.split()
        num_fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        return cls(int(fields["VmRSS"][0]), num_fds, int(fields["Threads"][0]))
