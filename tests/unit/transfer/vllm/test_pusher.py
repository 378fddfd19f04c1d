"""The push side's refusals, over a real ZMQ side channel and a fake agent (the WRITE itself
is proved against vLLM's own push decode, tests/interop/test_vllm_push.py): a decode whose
hash is not our push hash (a pull decode, another version), or whose blocks are not ours in
shape, is refused with the reason and its request's blocks freed; so is a decode of TP > 1,
one that registered more blocks than we staged, and one whose handshake never answers. A
decode of TP 2 is linked rank by rank and each rank gets one WRITE of its heads' slices of
our blocks (the fake agent records the lists and WRITEs; vLLM's own TP-2 push decode landing
them is tests/interop/test_vllm_worker_tp.py); one of TP 3 for our 2 heads is refused."""

from __future__ import annotations

import contextlib
import select
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from prefill_worker.transfer.nixl.poster import InlinePoster, WritePoster
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.vllm.handshake import SideChannel, encode_payload
from prefill_worker.transfer.vllm.link import LinkRefused, check_metadata, fetch_payload
from prefill_worker.transfer.vllm.profiles import PROFILES, LayerRegion, agent_metadata
from prefill_worker.transfer.vllm.push import Registration
from prefill_worker.transfer.vllm.pusher import PushJob, VllmPusher
from prefill_worker.transfer.vllm.staging import StagingLayout
from tests.polling import wait_until

LAYOUT = StagingLayout(2, 2, 32, 4, 32, 8)  # 2 layers, 2 heads of 32 fp32, blocks of 32
HASH = "a" * 64


def _payload(
    hash_: str = HASH,
    block_bytes: int = LAYOUT.block_bytes,
    version: str = "0.34.0",
    blob: bytes = b"blob",
) -> bytes:
    layers = [
        LayerRegion(f"model.layers.{i}.self_attn.attn", 4096 * i, block_bytes) for i in range(2)
    ]
    meta = agent_metadata(PROFILES[version], "decode-1", blob, layers, 16, 32, "CPU_ATTN")
    return encode_payload(hash_, meta)


def test_our_hash_and_shape_are_accepted() -> None:
    meta = check_metadata(_payload(), HASH, "0.34.0", "decode-1", LAYOUT)
    assert meta.num_blocks == 16 and meta.agent_metadata == b"blob"
    meta = check_metadata(_payload(version="0.33.0"), HASH, "0.33.0", "decode-1", LAYOUT)
    assert meta.kv_cache_layout == "LBHNC"


@pytest.mark.parametrize(
    ("payload", "engine", "why"),
    [
        (_payload("b" * 64), "decode-1", "compatibility hash mismatch.*decode in pull mode"),
        (_payload(block_bytes=LAYOUT.block_bytes // 2), "decode-1", "not ours in shape: blocks of"),
        (_payload(), "decode-2", "engine id 'decode-1', registered as 'decode-2'"),
        (b"\x01", "decode-1", "not vLLM's handshake payload"),
    ],
)
def test_a_decode_not_ours_is_refused_with_the_reason(
    payload: bytes, engine: str, why: str
) -> None:
    with pytest.raises(LinkRefused, match=why):
        check_metadata(payload, HASH, "0.34.0", engine, LAYOUT)


class _List:
    def __init__(self, name: str, table: Any) -> None:
        self.name, self.table = name, table

    def release(self) -> None:
        pass


class _Handle:
    def __init__(self, agent: _Agent, index: int) -> None:
        self.agent, self.index, self.is_released = agent, index, False

    def release(self) -> None:
        self.is_released = True


class _Agent:
    """What the pusher calls: the lists it prepares and the WRITEs it posts are recorded;
    nothing is copied. A WRITE's state is ``states[index]`` (DONE unless set); the one whose
    notification is in ``fail`` is an ERR."""

    def __init__(self) -> None:
        self.loaded: list[bytes] = []
        self.writes: list[tuple[_List, list[int], _List, list[int], bytes]] = []
        self.handles: list[_Handle] = []
        self.states: dict[int, str] = {}

    def prep_xfer_dlist(self, name: str, table: Any, mem: str) -> _List:
        return _List(name, table)

    def add_remote_agent(self, blob: bytes) -> str:
        self.loaded.append(blob)
        return blob.decode()

    def remove_remote_agent(self, name: str) -> None:
        self.loaded.remove(name.encode())

    def make_prepped_xfer(
        self, op: str, local: _List, lidx: Any, remote: _List, ridx: Any, notif: bytes
    ) -> _Handle:
        assert op == "WRITE"
        self.writes.append((local, list(lidx), remote, list(ridx), notif))
        self.handles.append(_Handle(self, len(self.handles)))
        return self.handles[-1]

    def transfer(self, handle: _Handle) -> str:
        return self.check_xfer_state(handle)

    def check_xfer_state(self, handle: _Handle) -> str:
        return self.states.get(handle.index, "DONE")

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


@pytest.fixture
def decode_channel() -> Iterator[SideChannel]:
    """A decode's side channel answering with the wrong hash (a decode in pull mode)."""
    channel = SideChannel("127.0.0.1", 0, {(0, 0): _payload("b" * 64)})
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [channel.serve(20) for _ in iter(stop.is_set, True)])
    thread.start()
    yield channel
    stop.set()
    thread.join()
    channel.close()


def _job(port: int, blocks: tuple[int, ...] = (0, 1), **reg: Any) -> PushJob:
    fields = {
        "request_id": "cmpl-x-0-00000000",
        "decode_engine_id": "decode-1",
        "decode_host": "127.0.0.1",
        "decode_port": port,
        "decode_tp_size": 1,
        "local_block_ids": [[5, 6]],
        **reg,
    }
    return PushJob("pw-1", blocks, Registration(**fields), "0.34.0")


def _pusher(freed: list[int], agent: _Agent, poster: WritePoster | None = None) -> VllmPusher:
    poster = InlinePoster(agent) if poster is None else poster
    hashes = {"0.34.0": HASH}
    return VllmPusher(agent, poster, [0, 1 << 20], LAYOUT, hashes, freed.extend, lambda: 0.0)


def test_a_refused_decode_gets_no_write_and_its_blocks_come_back(
    decode_channel: SideChannel,
) -> None:
    freed: list[int] = []
    agent = _Agent()
    pusher = _pusher(freed, agent)
    pusher.push(_job(decode_channel.port))
    pusher.push(_job(decode_channel.port, (2, 3)))  # the same decode: waits for the same link
    assert pusher.busy and pusher.num_blocks_owned == 4
    wait_until(lambda: (pusher.poll(), not pusher.busy)[1], 10.0, "the handshake's refusal")
    assert sorted(freed) == [0, 1, 2, 3] and pusher.counts.failed["handshake"] == 2
    assert agent.loaded == []  # its agent never loaded
    pusher.close()


@pytest.mark.parametrize(
    ("reg", "blocks", "why"),
    [({"decode_tp_size": 3}, (0, 1), "decode_tp"), ({"decode_tp_size": 0}, (2,), "decode_tp")],
)
def test_a_registration_not_served_frees_its_blocks_at_once(
    reg: dict[str, Any], blocks: tuple[int, ...], why: str
) -> None:
    freed: list[int] = []
    pusher = _pusher(freed, _Agent())
    pusher.push(_job(1, blocks, **reg))
    assert freed == list(blocks) and pusher.counts.failed[why] == 1 and not pusher.busy
    pusher.close()


def test_a_decode_with_more_blocks_than_staged_is_refused_after_its_link(
    decode_channel: SideChannel,
) -> None:
    freed: list[int] = []
    agent = _Agent()
    hashes = {"0.34.0": "b" * 64}
    pusher = VllmPusher(
        agent, InlinePoster(agent), [0, 1 << 20], LAYOUT, hashes, freed.extend, lambda: 0.0
    )
    pusher.push(_job(decode_channel.port, (4,), local_block_ids=[[5, 6]]))
    wait_until(lambda: (pusher.poll(), not pusher.busy)[1], 10.0, "the link")
    assert agent.loaded == [b"blob"]  # the hash was ours this time: its agent loaded
    assert freed == [4] and pusher.counts.failed["blocks"] == 1
    pusher.close()
    assert agent.loaded == []  # forgotten at close


def test_a_silent_side_channel_is_a_refusal_not_a_hang() -> None:
    silent = SideChannel("127.0.0.1", 0, {})  # bound, never answers
    try:
        with pytest.raises(LinkRefused, match="handshake with"):
            fetch_payload("127.0.0.1", silent.port, timeout_ms=100)
    finally:
        silent.close()


def test_a_decode_of_tp_2_gets_each_rank_its_heads_of_our_blocks() -> None:
    """Both ranks' metadata fetched over one side channel; rank r's WRITE goes from the r-th
    half of each of our blocks (one of our two heads) to its own blocks, with "<id>:1"."""
    half = LAYOUT.block_bytes // 2
    ranks = {(0, r): _payload(block_bytes=half, blob=f"rank-{r}".encode()) for r in range(2)}
    channel = SideChannel("127.0.0.1", 0, ranks)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [channel.serve(20) for _ in iter(stop.is_set, True)])
    thread.start()
    freed: list[int] = []
    agent = _Agent()
    pusher = _pusher(freed, agent)
    try:
        pusher.push(_job(channel.port, (1, 2), decode_tp_size=2, local_block_ids=[[5, 9]]))
        wait_until(lambda: (pusher.poll(), not pusher.busy)[1], 10.0, "the link and WRITEs")
    finally:
        stop.set()
        thread.join()
        channel.close()
    assert agent.loaded == [b"rank-0", b"rank-1"] and pusher.counts.pushed == 1
    assert sorted(freed) == [1, 2]
    assert [(w[2].name, w[4]) for w in agent.writes] == [
        ("rank-0", b"cmpl-x-0-00000000:1"),
        ("rank-1", b"cmpl-x-0-00000000:1"),
    ]
    bases = (0, 1 << 20)
    for rank, (local, lidx, remote, ridx, _) in enumerate(agent.writes):
        rows = local.table[lidx]
        want = [
            bases[layer] + b * LAYOUT.block_bytes + rank * half for layer in (0, 1) for b in (1, 2)
        ]
        assert rows[:, 0].tolist() == want and set(rows[:, 1].tolist()) == {half}
        assert [remote.table[i][0] for i in ridx] == [
            4096 * layer + b * half for layer in (0, 1) for b in (5, 9)
        ]
    pusher.close()
    assert agent.loaded == []


def test_a_rank_holding_whole_blocks_is_not_a_rank_of_tp_2() -> None:
    with pytest.raises(LinkRefused, match="1/2 of a block: a rank's heads"):
        check_metadata(_payload(), HASH, "0.34.0", "decode-1", LAYOUT, 2)


@contextlib.contextmanager
def _decode(ranks: dict[tuple[int, int], bytes]) -> Iterator[SideChannel]:
    """A decode's side channel serving ``ranks``' payloads from a thread."""
    channel = SideChannel("127.0.0.1", 0, ranks)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [channel.serve(20) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        yield channel
    finally:
        stop.set()
        thread.join()
        channel.close()


def _linked(pusher: VllmPusher, agent: _Agent, n: int = 1) -> None:
    wait_until(lambda: (pusher.poll(), len(agent.writes) >= n)[1], 10.0, "the link")


def test_a_write_settling_on_the_transfer_thread_wakes_the_engine() -> None:
    """Through a real ``PushThread``: the handshake's agent and lists are loaded on it, the
    WRITE is posted there and, while in flight, asks for no polling; its end writes the wake
    fd, and the poll that follows frees the blocks."""
    agent = _Agent()
    agent.states[0] = "PROC"
    freed: list[int] = []
    pusher = _pusher(freed, agent, PushThread(agent, "test-vllm-push"))
    with _decode({(0, 0): _payload()}) as channel:
        pusher.push(_job(channel.port))
        assert pusher.needs_polling  # the link: no fd
        _linked(pusher, agent)
    assert agent.loaded == [b"blob"] and pusher.busy and not pusher.needs_polling
    fd = pusher.wake_fd
    assert fd is not None
    agent.states[0] = "DONE"
    for _ in range(3):  # each turn only once the fd says so (the post, then the end)
        assert select.select([fd], [], [], 10.0)[0] == [fd]
        pusher.poll()  # clears the fd, then reads the states
        if not pusher.busy:
            break
    assert not pusher.busy and pusher.counts.pushed == 1 and sorted(freed) == [0, 1]
    assert agent.handles[0].is_released
    pusher.close()
    assert agent.loaded == []


def test_a_rank_that_fails_releases_the_other_and_the_blocks_come_back_once_settled() -> None:
    half = LAYOUT.block_bytes // 2
    ranks = {(0, r): _payload(block_bytes=half, blob=f"rank-{r}".encode()) for r in range(2)}
    agent = _Agent()
    agent.states.update({0: "ERR", 1: "PROC"})
    freed: list[int] = []
    pusher = _pusher(freed, agent)
    with _decode(ranks) as channel:
        pusher.push(_job(channel.port, (1, 2), decode_tp_size=2, local_block_ids=[[5, 9]]))
        wait_until(lambda: (pusher.poll(), not pusher.busy)[1], 10.0, "the link and WRITEs")
    assert len(agent.writes) == 2 and all(h.is_released for h in agent.handles)
    assert sorted(freed) == [1, 2] and pusher.counts.failed["write"] == 1
    assert pusher.counts.pushed == 0 and agent.loaded == []  # forgotten: the next one links
    pusher.close()


def test_a_write_past_its_timeout_is_released_and_its_blocks_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("prefill_worker.transfer.vllm.pusher.WRITE_TIMEOUT_S", 0.0)
    agent = _Agent()
    agent.states[0] = "PROC"  # never ends
    freed: list[int] = []
    pusher = _pusher(freed, agent)
    with _decode({(0, 0): _payload()}) as channel:
        pusher.push(_job(channel.port))
        wait_until(lambda: (pusher.poll(), not pusher.busy)[1], 10.0, "the timeout")
    assert agent.handles[0].is_released and sorted(freed) == [0, 1]
    assert pusher.counts.failed["write"] == 1 and agent.loaded == []
    pusher.close()


def test_a_failed_write_fails_the_others_in_flight_to_that_decode_before_forgetting_it() -> None:
    """Its lists are released only after no WRITE of them is in flight; one already DONE
    counts as pushed."""
    agent = _Agent()
    agent.states.update({0: "PROC", 1: "PROC", 2: "PROC"})
    freed: list[int] = []
    pusher = _pusher(freed, agent)
    with _decode({(0, 0): _payload()}) as channel:
        pusher.push(_job(channel.port))
        _linked(pusher, agent)
        pusher.push(_job(channel.port, (2, 3)))
        pusher.push(_job(channel.port, (4, 5)))
    assert len(agent.writes) == 3 and pusher.num_blocks_owned == 6
    agent.states.update({1: "ERR", 2: "DONE"})
    pusher.poll()
    assert pusher.counts.failed["write"] == 1  # the ERR; the first abandoned this turn
    pusher.poll()
    assert not pusher.busy and sorted(freed) == [0, 1, 2, 3, 4, 5]
    assert pusher.counts.failed["write"] == 2 and pusher.counts.pushed == 1
    assert all(h.is_released for h in agent.handles) and agent.loaded == []
    pusher.close()


def test_close_cancels_the_writes_in_flight_then_frees_their_blocks() -> None:
    agent = _Agent()
    agent.states[0] = "PROC"
    freed: list[int] = []
    pusher = _pusher(freed, agent, PushThread(agent, "test-vllm-push"))
    with _decode({(0, 0): _payload()}) as channel:
        pusher.push(_job(channel.port))
        _linked(pusher, agent)
    pusher.poll()
    assert pusher.busy and not freed
    pusher.close()
    assert agent.handles[0].is_released and sorted(freed) == [0, 1] and agent.loaded == []
