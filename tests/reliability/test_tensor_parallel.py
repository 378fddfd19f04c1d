"""A tensor-parallel worker: real rank processes (gloo on CPU) behind one worker process.

Equality: the same requests, in the same order, to a TP-1, a TP-2 and a TP-4 worker (4
attention heads, 2 KV heads: split at TP 2, replicated at TP 4): a chunked prompt, a prompt
that hits the first one's cached prefix, then three at once (batched). First tokens and their
logprobs agree within 1e-4 (fp32); every rank's whole pool, saved when SIGTERM drained the
worker (``testing.tp_ranks --dump-dir``), equals the TP-1 worker's pool at that rank's heads
(``parallel.kv_head_range``). Transfer: every rank pushes its own heads, so native decodes of
TP 1 (every head), 2 (a receiver per head) and 4 (each head on two receivers) receive the
whole KV: byte for byte what each worker rank's pool holds, and within 1e-4 of the TP-1
worker's KV. The leader's /metrics shows every rank's forward times, and every rank's written
bytes: exactly its planned heads of each room's pages (rank 0's with the aux rows), summing to
the group's ``prefill_worker_transfer_bytes_total``. Each follower holds every rank of a
ranked decode while it holds a room, and forgets them once it said `bye`
(``prefill_worker_tp_decode_peers``).

Faults (TP 2): a follower killed (-9) under load, a follower stopped (SIGSTOP) past the step
timeout, a follower whose forward raises (``testing.tp_ranks --fail-rank``): the worker exits
non-zero within ``EXIT_BOUND_S``, every request gets its one reply, the decode hears every
room it was promised fail (or finish), and no rank process is left. A restart on the same
ports serves again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from prefill_worker.ingress.messages import Result
from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.model.parallel import TPGroup, kv_head_range
from prefill_worker.request import OutcomeStatus
from prefill_worker.service.config import load_config
from prefill_worker.service.daemon import Daemon
from prefill_worker.testing.launch import ChildProcess, free_port
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from prefill_worker.transfer.headplan import plan_rank
from prefill_worker.transfer.wire import WorkerTP
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import (
    DECODE_PAGES,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    PAGE_SIZE,
    ROOT,
    Worker,
    decode_pool,
    start_worker,
    wait_ready,
)
from tests.integration.transfer.test_bootstrap_guard import listening
from tests.patience import patient
from tests.polling import wait_until
from tests.reliability.harness import Ledger, LiveDecode, Router, scrape

TOL = 1e-4
TRANSFER_BYTES = "prefill_worker_transfer_bytes_total"
DECODE_PEERS = "prefill_worker_tp_decode_peers"
PEERS_SETTLE_S = patient(10.0)  # a `bye` reaches the followers at the next exchange (0.5 s)
HEAD_PAGE_BYTES = 2 * NUM_LAYERS * PAGE_SIZE * HEAD_DIM * 4  # one head's K and V, a page, fp32
TP_MODULE = "prefill_worker.testing.tp_ranks"
# A short step timeout makes a stopped rank's test quick; on a busy machine a step of four
# ranks on two cores takes longer, so it grows with the tests' patience (tests/patience.py).
STEP_TIMEOUT_S, HEARTBEAT_S = patient(3.0), 0.5
FAST = (f"parallel.step_timeout_s={STEP_TIMEOUT_S}", f"parallel.heartbeat_interval_s={HEARTBEAT_S}")
# docs/parallelism.md: a dead rank is seen within the supervisor's period (0.25 s) or at the
# next collective; a stopped one within heartbeat + step timeout; then the engine's shutdown.
EXIT_BOUND_S = HEARTBEAT_S + STEP_TIMEOUT_S + patient(5.0)
LONG = prompt(40, seed=1)  # 3 chunks of 16
HIT = [*LONG[:32], *prompt(9, seed=2)]  # 8 cached pages of 4 tokens
BATCH = [prompt(11 + 3 * i, seed=10 + i) for i in range(3)]


class Session:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.decode = LiveDecode(worker.bootstrap)
        self.ledger = Ledger()
        self.router = Router(worker.ingress, self.ledger)
        self._rooms = iter(range(1, 10_000))

    def send(self, token_ids: Sequence[int], request_id: str | None = None) -> tuple[str, int]:
        room = next(self._rooms)
        self.decode.want(room, len(token_ids))
        rid = self.router.send_prefill(token_ids, room, return_logprob=True, request_id=request_id)
        return rid, room

    def close(self) -> None:
        self.router.close()
        self.decode.close()


class RankedDecode:
    """A native decode of TP ``size``: one ``KVReceiver`` per rank over a pool of its KV
    heads, each wanting every room with its own pages (the same page ids: separate pools)."""

    def __init__(self, bootstrap: str, size: int) -> None:
        kind = describe_worker(bootstrap, 30.0).kind
        self.heads = [kv_head_range(NUM_KV_HEADS, TPGroup(rank, size)) for rank in range(size)]
        self.pools = [decode_pool(kind, len(heads)) for heads in self.heads]
        self.receivers = [
            KVReceiver.from_tensors(
                k, v, bootstrap, num_aux_rows=8, tp=(rank, size, NUM_KV_HEADS), io_thread=True
            )
            for rank, (k, v) in enumerate(self.pools)
        ]
        for receiver in self.receivers:
            receiver.wait_registered(timeout_s=patient(30))
        self.rooms: dict[int, list[int]] = {}

    @property
    def worker_tp(self) -> WorkerTP:
        """The worker's TP layout, as its `registered` named it to rank 0."""
        worker_tp = self.receivers[0].worker_tp
        assert worker_tp is not None
        return worker_tp

    def want(self, room: int, num_tokens: int) -> None:
        pages = [DECODE_PAGES - 1 - 2 * i for i in range(-(-num_tokens // PAGE_SIZE))]
        self.rooms[room] = pages
        for receiver in self.receivers:
            receiver.want(room, pages, 0, 0)

    def wait(self, room: int) -> None:
        def settled() -> bool:
            return all(r.poll(room).state is not RoomState.PENDING for r in self.receivers)

        wait_until(settled, 30.0, f"room {room} on every decode rank")
        states = [r.poll(room) for r in self.receivers]
        assert all(s.state is RoomState.DONE for s in states), states

    def pages(self, room: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the room's pages, each head from its ranks: [pages, ps, KV, D]; ranks
        that hold the same (replicated) head must hold the same bytes."""
        out = []
        for part in range(2):
            whole: list[torch.Tensor | None] = [None] * NUM_KV_HEADS
            for heads, pool in zip(self.heads, self.pools, strict=True):
                mine = torch.stack([pool[part][layer][p] for p in self.rooms[room]])
                for i, head in enumerate(heads):
                    got = mine[:, :, i]
                    assert whole[head] is None or torch.equal(whole[head], got), head
                    whole[head] = got
            out.append(torch.stack(whole, 2))  # type: ignore[arg-type]
        return out[0], out[1]

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


def start(tmp_path: Path, checkpoint: Path, tp: int, *settings: str, args: Sequence[str] = ()):
    worker = start_worker(
        tmp_path, checkpoint, f"parallel.tp_size={tp}", *FAST, *settings,
        module=TP_MODULE, module_args=args,
    )  # fmt: skip
    try:
        wait_ready(worker)
    except BaseException:
        worker.child.kill()
        raise
    return worker


def tp1_pages(session: Session, room: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the room's pages on the TP-1 decode: [pages, page_size, KV, D]."""
    pages, _ = session.decode.rooms[room]
    k, v = session.decode.k[layer], session.decode.v[layer]
    return torch.stack([k[p] for p in pages]), torch.stack([v[p] for p in pages])


def follower_peers(worker: Worker, tp: int) -> list[int]:
    """``prefill_worker_tp_decode_peers`` of ranks 1 .. tp-1: the decode ranks each holds."""
    samples = scrape(worker)
    return [int(samples[(DECODE_PEERS, (("rank", str(rank)),))]) for rank in range(1, tp)]


def peers_once_settled(worker: Worker, tp: int, expected: list[int]) -> list[int]:
    """The followers' decode peers once they equal ``expected``, or at ``PEERS_SETTLE_S``."""
    deadline = time.monotonic() + PEERS_SETTLE_S
    while (peers := follower_peers(worker, tp)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return peers


def to_ranked_decode(session: Session, tp: int, size: int) -> tuple[tuple, list[list[int]]]:
    """LONG once more, to a native decode of TP ``size``: the reply, and K and V per layer;
    and the followers' decode peers before it registered, while it held its room, and after
    it closed (said `bye`)."""
    before = follower_peers(session.worker, tp)
    decode = RankedDecode(session.worker.bootstrap, size)
    try:
        ranks = [(r.tp_rank, r.head_start, r.head_stop) for r in decode.worker_tp.ranks]
        heads = [kv_head_range(NUM_KV_HEADS, TPGroup(rank, tp)) for rank in range(tp)]
        assert ranks == [(rank, h.start, h.stop) for rank, h in enumerate(heads)]
        room = 9_000 + size
        decode.want(room, len(LONG))
        rid = f"long-d{size}"
        session.router.send_prefill(LONG, room, return_logprob=True, request_id=rid)
        reply = session.router.wait([rid])[rid]
        decode.wait(room)
        pages = [decode.pages(room, layer) for layer in range(2)]
        during = follower_peers(session.worker, tp)
    finally:
        decode.close()
    return (reply, pages), [before, during, peers_once_settled(session.worker, tp, before)]


def serve_script(session: Session, tp: int) -> dict[str, object]:
    """The requests, serially then batched; first tokens, logprobs, prefix hits, decode KV
    (per layer, K and V of the room's pages); last, LONG twice more, at TP > 1 to decodes of
    TP 2 and 4."""
    out: dict[str, object] = {}
    for name, tokens in (("long", LONG), ("hit", HIT)):
        rid, room = session.send(tokens)
        reply = session.router.wait([rid])[rid]
        assert session.decode.wait([room])[room].state is RoomState.DONE
        out[name] = reply, [tp1_pages(session, room, layer) for layer in range(2)]
    sent = [session.send(tokens) for tokens in BATCH]
    replies = session.router.wait([rid for rid, _ in sent])
    session.decode.wait([room for _, room in sent])
    for i, (rid, _) in enumerate(sent):
        out[f"batch{i}"] = replies[rid], None
    readyz = json.loads(session.worker.http("/readyz")[1])
    assert readyz["kv_layout"] == describe_worker(session.worker.bootstrap, 10.0).summary()
    assert readyz["kv_layout"]["num_kv_heads"] == NUM_KV_HEADS  # every head, at any TP
    for size in (2, 4):  # a TP-1 worker does the same work (its pools stay comparable) for
        if tp > 1:  # its TP-1 decode (tests/integration/daemon/test_decode_tp.py has d > 1)
            out[f"long-d{size}"], out[f"peers-d{size}"] = to_ranked_decode(session, tp, size)
        else:
            rid, room = session.send(LONG, f"long-d{size}")
            out[f"long-d{size}"] = session.router.wait([rid])[rid], None
            assert session.decode.wait([room])[room].state is RoomState.DONE
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[dict]:
    """Each TP size's answers and its ranks' pools at exit, one worker at a time."""
    results = {}
    for tp in (1, 2, 4):
        tmp_path = tmp_path_factory.mktemp(f"tp{tp}")
        worker = start(tmp_path, checkpoint, tp, args=["--dump-dir", str(tmp_path)])
        session = Session(worker)
        try:
            answers = serve_script(session, tp)
            listeners = {a for pid in process_tree(worker.proc.pid) for a in listening(pid)}
            samples = scrape(worker)
            forwards = {
                labels: value
                for (name, labels), value in samples.items()
                if name == "prefill_worker_tp_forward_seconds_count"
            }
            written = {
                dict(labels).get("rank", "total"): value
                for (name, labels), value in samples.items()
                if name in ("prefill_worker_tp_write_bytes_total", TRANSFER_BYTES)
            }
        except BaseException:
            worker.child.kill()  # no worker outlives a failed script
            raise
        finally:
            session.close()
        assert worker.child.stop() == 0, worker.log()  # SIGTERM drains every rank
        pools = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(tp)]
        results[tp] = answers, pools, forwards, written, listeners
    yield results


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the leader, then the ranks it started)."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").iterdir():
            tree += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return tree


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_listens_on_loopback_only(served: dict, tp: int) -> None:
    """The rendezvous store (before: TCPStore bound every interface, with no authentication),
    gloo's pairs (given ``lo``), the ZMQ, HTTP and UCX listeners: 127.0.0.1, on every rank."""
    listeners = served[tp][4]
    assert len(listeners) > 4, listeners  # the leader's edges and the ranks' own sockets
    assert {ip for ip, _ in listeners} == {"127.0.0.1"}, sorted(listeners)


@pytest.mark.parametrize("tp", [2, 4])
def test_first_tokens_and_logprobs_equal_tp1(served: dict, tp: int) -> None:
    expected, got = served[1][0], served[tp][0]
    for name, (reply, _) in expected.items():
        other = got[name][0]
        assert isinstance(reply, Result) and isinstance(other, Result), (reply, other)
        assert reply.status is other.status is OutcomeStatus.OK, (reply, other)
        assert other.first_token_id == reply.first_token_id, name
        assert abs(other.first_token_logprob - reply.first_token_logprob) <= TOL, name
    assert got["hit"][0].num_prefix_hit_tokens == 32  # the cached prefix was used


def full_pages(num_tokens: int) -> int:
    return num_tokens // PAGE_SIZE  # the last, partial page may be reused after the request


RECEIVED = [("long", 40), ("hit", 41), ("long-d2", 40), ("long-d4", 40)]  # name, tokens


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("name", "num_tokens"), RECEIVED)
def test_decodes_of_tp_1_2_4_receive_every_head_of_the_tp1_kv(
    served: dict, tp: int, name: str, num_tokens: int
) -> None:
    """Within 1e-4 of the TP-1 worker's KV (a TP-2 forward sums in another order)."""
    expected = served[1][0]["long" if name.startswith("long") else name][1]
    for (k1, v1), (k, v) in zip(expected, served[tp][0][name][1], strict=True):
        for got, want in ((k, k1), (v, v1)):
            got = got.flatten(0, 1)[:num_tokens]
            torch.testing.assert_close(got, want.flatten(0, 1)[:num_tokens], atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("tp", "name", "num_tokens"),
    [(1, "long", 40), (1, "hit", 41)] + [(tp, name, n) for tp in (2, 4) for name, n in RECEIVED],
)
def test_every_head_lands_byte_for_byte_from_its_ranks_pool(
    served: dict, tp: int, name: str, num_tokens: int
) -> None:
    """Each full page the decode received is, at every rank's heads, one page of that rank's
    pool bit for bit, the same page on every rank."""
    pools, received = served[tp][1], served[tp][0][name][1]
    heads = [kv_head_range(NUM_KV_HEADS, TPGroup(rank, tp)) for rank in range(tp)]

    def holds(rank: int, page: int, i: int) -> bool:
        cut = slice(heads[rank].start, heads[rank].stop)
        return all(
            torch.equal(tensor[i][:, cut], pools[rank][part][layer][page])
            for layer, (k, v) in enumerate(received)
            for part, tensor in (("k", k), ("v", v))
        )

    num_pages = len(pools[0]["k"][0])
    for i in range(full_pages(num_tokens)):
        found = [p for p in range(num_pages) if all(holds(r, p, i) for r in range(tp))]
        assert found, f"page {i} of {name}: no page holds it on every rank"


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_pool_holds_the_tp1_pool_at_its_heads(served: dict, tp: int) -> None:
    (whole,) = served[1][1]
    for rank, pool in enumerate(served[tp][1]):
        heads = kv_head_range(NUM_KV_HEADS, TPGroup(rank, tp))
        for part in ("k", "v"):
            for layer, tensor in enumerate(pool[part]):  # [P, page_size, local KV, D]
                expected = whole[part][layer][:, :, heads.start : heads.stop]
                torch.testing.assert_close(tensor, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_metrics_show_every_rank_forward(served: dict, tp: int) -> None:
    forwards = served[tp][2]
    assert set(forwards) == {(("rank", str(rank)),) for rank in range(tp)}
    assert len(set(forwards.values())) == 1 and min(forwards.values()) > 0  # every step
    assert served[1][2] == {}  # no group, no series


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("size", [2, 4])
def test_each_follower_forgets_a_decode_that_left(served: dict, tp: int, size: int) -> None:
    """A native decode of TP ``size`` registers, gets a room, says `bye`: every follower held
    each of its ranks (their agents mirrored for the room) and, after the bye, holds what it
    held before (the leader's drop mirrored); the decode of TP 4, with new names, comes after
    the TP-2 one left and is served (its KV: the tests above)."""
    before, during, after = served[tp][0][f"peers-d{size}"]
    assert during == [n + size for n in before]
    assert after == before


def rooms_written(tp: int) -> list[tuple[int, int]]:
    """(pages, decode TP) of every room ``serve_script`` sent (docs: its docstring)."""
    rooms = [(-(-len(tokens) // PAGE_SIZE), 1) for tokens in (LONG, HIT, *BATCH)]
    return rooms + [(-(-len(LONG) // PAGE_SIZE), size if tp > 1 else 1) for size in (2, 4)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_metrics_count_every_ranks_writes_exactly(served: dict, tp: int) -> None:
    """The group's ``prefill_worker_transfer_bytes_total`` is the sum of its ranks'
    ``prefill_worker_tp_write_bytes_total``, and each rank's is exactly its heads (the plan's
    slices) of every room's pages, K and V of each layer; rank 0's with an aux row per decode
    rank of each room. At TP 4 (a head on two ranks) ranks 1 and 3 write only into the decode of
    TP 4 (each its own decode rank's heads)."""
    written = served[tp][3]
    expected = [0] * tp
    for num_pages, size in rooms_written(tp):
        for rank in range(tp):
            heads = sum(s.num_heads for s in plan_rank(NUM_KV_HEADS, rank, tp, size))
            expected[rank] += num_pages * heads * HEAD_PAGE_BYTES
        expected[0] += size * AUX_ROW_BYTES
    if tp == 1:
        assert written == {"total": expected[0]}  # no group, no rank series
        return
    assert [written[str(rank)] for rank in range(tp)] == expected
    assert written["total"] == sum(expected)


def test_under_torchrun_each_process_is_one_rank(
    served: dict, tmp_path: Path, checkpoint: Path
) -> None:
    """torchrun starts both ranks (RANK, WORLD_SIZE set: no spawning); the leader serves as
    the TP-1 worker does; SIGTERM to it drains both ranks and torchrun exits 0."""
    ingress, bootstrap = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    flags = [
        f"model.path={checkpoint}", f"ingress.bind={ingress}",
        f"transfer.bootstrap_bind={bootstrap}", f"metrics.bind=127.0.0.1:{http_port}",
        "parallel.tp_size=2", *FAST,
    ]  # fmt: skip
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    args += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    args += ["-m", "prefill_worker", "serve", "configs/tiny-test.yaml"]
    for flag in flags:
        args += ["--set", flag]
    child = ChildProcess.start("torchrun", args, tmp_path, cwd=ROOT)
    worker = Worker(child, ingress, bootstrap, http_port)
    try:
        wait_ready(worker)
        session = Session(worker)
        try:
            rid, room = session.send(LONG)
            reply = session.router.wait([rid])[rid]
            assert session.decode.wait([room])[room].state is RoomState.DONE
        finally:
            session.close()
        expected = served[1][0]["long"][0]
        assert isinstance(reply, Result) and reply.first_token_id == expected.first_token_id
        leader_pid = json.loads(worker.http("/readyz")[1])["pid"]
        os.kill(leader_pid, signal.SIGTERM)
        assert worker.wait_exit(60) == 0, worker.log()
    finally:
        child.kill()


# ── failing as one ───────────────────────────────────────────────────────────────────────────


def rank_pids(leader_pid: int) -> list[int]:
    """Every process on this machine started as a follower of ``leader_pid``."""
    marker = f"--parent-pid\0{leader_pid}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker in cmdline + b"\0" and state != "Z":
            found.append(int(entry))
    return found


def check_failed_as_one(session: Session, rids: list[str], started_at: float) -> None:
    worker = session.worker
    code = worker.wait_exit(EXIT_BOUND_S + 30)
    elapsed_s = time.monotonic() - started_at
    assert code == 70, worker.log()
    assert elapsed_s <= EXIT_BOUND_S, f"exited {elapsed_s:.1f} s after the fault\n{worker.log()}"
    session.ledger.wait_answered(10)
    session.ledger.check_exactly_one()
    for rid in rids:
        reply = session.ledger.replies[(session.router.conn, rid)][0]
        assert isinstance(reply, Result), reply
        if reply.status is not OutcomeStatus.OK:
            assert reply.reason.value == "engine_error", reply
    statuses = session.decode.wait(list(session.decode.rooms), timeout_s=30)
    assert all(s.state in (RoomState.DONE, RoomState.FAILED) for s in statuses.values())
    assert any(s.state is RoomState.FAILED for s in statuses.values()), statuses
    wait_until(lambda: not rank_pids(worker.proc.pid), 10, "no rank process left")


def under_load(session: Session, num: int = 8, prefix: str = "load") -> list[str]:
    return [session.send(prompt(30 + i, seed=i), f"{prefix}-{i}")[0] for i in range(num)]


def restart_serves(tmp_path: Path, checkpoint: Path, worker: Worker) -> None:
    """A new worker on the same ports serves a request."""
    same = (
        f"ingress.bind={worker.ingress}",
        f"transfer.bootstrap_bind={worker.bootstrap}",
        f"metrics.bind=127.0.0.1:{worker.http_port}",
    )
    again = start(tmp_path, checkpoint, 2, *same)  # the later --set wins
    again = dataclasses.replace(
        again, ingress=worker.ingress, bootstrap=worker.bootstrap, http_port=worker.http_port
    )
    try:
        session = Session(again)
        try:
            rid, room = session.send(LONG)
            reply = session.router.wait([rid])[rid]
            assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
            assert session.decode.wait([room])[room].state is RoomState.DONE
        finally:
            session.close()
    finally:
        assert again.child.stop() == 0, again.log()
    assert not rank_pids(again.proc.pid)


def test_a_killed_follower_stops_the_worker_and_a_restart_serves(
    tmp_path: Path, checkpoint: Path
) -> None:
    session = Session(start(tmp_path, checkpoint, 2))
    try:
        (follower,) = rank_pids(session.worker.proc.pid)
        rids = under_load(session)
        started_at = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        check_failed_as_one(session, rids, started_at)
    finally:
        session.close()
    restart_serves(tmp_path, checkpoint, session.worker)


def test_a_stopped_follower_is_reported_stuck_and_stops_the_worker(
    tmp_path: Path, checkpoint: Path
) -> None:
    session = Session(start(tmp_path, checkpoint, 2))
    (follower,) = rank_pids(session.worker.proc.pid)
    try:
        os.kill(follower, signal.SIGSTOP)
        started_at = time.monotonic()

        def reported_stuck() -> bool:
            status, body = session.worker.http("/livez")
            return status == 503 and "tensor-parallel rank" in body

        wait_until(reported_stuck, STEP_TIMEOUT_S, "/livez to report the stopped rank")
        rids = under_load(session, 4)
        check_failed_as_one(session, rids, started_at)
    finally:
        if Path(f"/proc/{follower}").exists():
            os.kill(follower, signal.SIGCONT)
        session.close()


def test_a_follower_stopped_mid_forward_is_reported_at_once(
    tmp_path: Path, checkpoint: Path
) -> None:
    """Rank 1 stops itself (SIGSTOP) at the start of a forward: the leader is inside its own
    share of that forward, waiting in the model's collectives, where no step waits on the
    ranks (before: ``/livez`` said 200 until the collective timed out, ~step_timeout_s; docs
    say about 1 s). The supervisor sees the rank's state at once; the group fails as one."""
    args = ["--fail-rank", "1", "--fail-on", "freeze", "--fail-how", "stop"]
    session = Session(start(tmp_path, checkpoint, 2, args=args))
    (follower,) = rank_pids(session.worker.proc.pid)
    try:
        session.send(prompt(30, seed=5), "freeze-0")
        wait_until(lambda: _state(follower) == "T", 30, "the rank to stop itself")
        started_at = time.monotonic()
        status, body = session.worker.http("/livez")
        assert status == 503 and "rank 1" in body and "is stopped" in body, (status, body)
        assert time.monotonic() - started_at < STEP_TIMEOUT_S
        check_failed_as_one(session, ["freeze-0"], started_at)
    finally:
        if Path(f"/proc/{follower}").exists():
            os.kill(follower, signal.SIGCONT)
        session.close()
        session.worker.child.kill()  # a failed check leaves no worker behind (exited: no-op)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_a_rank_whose_forward_raises_stops_the_worker(tmp_path: Path, checkpoint: Path) -> None:
    args = ["--fail-rank", "1", "--fail-on", "poison"]
    session = Session(start(tmp_path, checkpoint, 2, args=args))
    try:
        rids = under_load(session, 4)
        started_at = time.monotonic()
        rids.append(session.send(prompt(20, seed=99), "poison-1")[0])
        check_failed_as_one(session, rids, started_at)
        poisoned = session.ledger.replies[(session.router.conn, "poison-1")][0]
        assert poisoned.status is OutcomeStatus.FAILED
    finally:
        session.close()


# ── refused at start-up ──────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (("parallel.tp_size=3",), "4 attention heads do not split over 3 ranks"),
        (("parallel.tp_size=2", "model.device=cuda"), "needs 2 CUDA devices; this host has 0"),
    ],
)
def test_a_group_that_cannot_run_is_refused_with_exit_78(
    checkpoint: Path, settings: tuple[str, ...], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before any rank starts (the daemon in this process: no rank process may appear)."""
    flags = [f"model.path={checkpoint}", "metrics.bind=127.0.0.1:0", *settings]
    config = load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags)
    assert Daemon(config, env={}).run() == 78
    assert says in caplog.text
    assert not rank_pids(os.getpid())


# A process that reaches the rendezvous store and joins as rank 1 without the group's secret
# (it ignores the one the leader hands it on stdin and answers the challenge with its own).
IMPOSTOR = """
import sys, datetime
import torch.distributed as dist
from prefill_worker.tp.secret import prove_membership
port = int(sys.argv[sys.argv.index("--port") + 1])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(60))
dist.init_process_group("gloo", store=store, rank=1, world_size=2)
group = dist.new_group(backend="gloo")  # as a rank does
try:
    prove_membership(b"not the group's secret, guessed", 1, 2, group)
except ValueError:
    pass
"""


def test_a_process_that_joins_without_the_groups_secret_fails_the_start(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the store let any process join as a rank and the group started with it (it
    would have been sent every step's plan). Now the leader names it and exits 78."""
    flags = [f"model.path={checkpoint}", "metrics.bind=127.0.0.1:0", "parallel.tp_size=2"]
    config = load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags)
    impostor = [sys.executable, "-c", IMPOSTOR]
    assert Daemon(config, env={}, rank_command=impostor).run() == 78
    assert "rank(s) 1 of the group do not hold its secret" in caplog.text
    assert not rank_pids(os.getpid())


def test_a_rank_that_never_joins_fails_the_start_at_the_rendezvous_timeout(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower that starts but never joins (the daemon's ``rank_command`` seam): exit 1
    after ``parallel.rendezvous_timeout_s``, never a hang in ``init_process_group``."""
    flags = [f"model.path={checkpoint}", "metrics.bind=127.0.0.1:0", "parallel.tp_size=2"]
    flags.append("parallel.rendezvous_timeout_s=2")
    config = load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags)
    silent = [sys.executable, "-c", "import time; time.sleep(600)"]
    started = time.monotonic()
    assert Daemon(config, env={}, rank_command=silent).run() == 1
    assert time.monotonic() - started < 30
    assert "rendezvous: not every rank answered within 2 s" in caplog.text
    assert not rank_pids(os.getpid())
