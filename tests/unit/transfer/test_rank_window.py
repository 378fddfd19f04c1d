"""A follower rank's writes into a decode rank with a hybrid SWA pool (SGLang's, mirrored by
the leader as a `register` naming the pool, ``transfer.nixl.rank_backend``): its KV list
gets our full layers' pages, its SWA pool our sliding layers' window pages
(``swa_window.window_slots`` of the mirrored ``WindowWant``), this rank's head of each; the
want survives the group's step encoding. A fake agent stands in for NIXL (the real writes:
tests/interop/test_swa_worker_tp.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout, KVRegions
from prefill_worker.kv.state_layout import PAGES, StateComponent, StateTensor
from prefill_worker.tp.step import decode_step, encode_step
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.group import MirrorOp
from prefill_worker.transfer.nixl.rank_backend import RankBackend
from prefill_worker.transfer.nixl.rank_writer import RankPlace
from prefill_worker.transfer.swa_window import SWA_KIND, WindowWant, window_slots
from tests.clocks import FakeClock
from tests.unit.transfer.test_rank_backend import FakeAgent

LAYERS, SLIDING, DIM, PAGE, PAGES_ = 3, (0, 2), 4, 4, 8
SWA_PAGES = 6
BASE = 0x10000


class TableAgent(FakeAgent):
    """Also keeps each prepared list's table, by the agent it names."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[int]]]] = []

    def prep_xfer_dlist(self, name: str, table: Any, mem: str) -> Any:
        self.tables.append((name, np.asarray(table).tolist()))
        return super().prep_xfer_dlist(name, table, mem)


def ours(num_heads: int = 1) -> KVRegions:
    layout = KVLayout(LAYERS, num_heads, DIM, "float32", PAGE, PAGES_, LAYER_MAJOR)
    step = layout.region_bytes
    k = tuple(BASE + i * step for i in range(LAYERS))
    v = tuple(BASE + (LAYERS + i) * step for i in range(LAYERS))
    return KVRegions(layout, k, v, "cpu", 0x900000, 4)


def swa_register(name: str, rank: int, tp: int) -> wire.Register:
    """A decode rank of attention TP ``tp`` (2 heads over its ranks): its KV list the full
    layer, its SWA pool the 2 sliding layers' K then V in ``SWA_PAGES`` pages."""
    heads = 2 // tp
    layout = KVLayout(1, heads, DIM, "float32", PAGE, PAGES_, LAYER_MAJOR)
    kv = KVRegions(layout, (0x100000,), (0x200000,), "cpu", 0x900000, 4)
    page = layout.page_bytes
    tensors = tuple(StateTensor(n, (PAGE, heads, DIM), "float32", page) for n in "kv")
    swa = StateComponent(SWA_KIND, SLIDING, tensors, SWA_PAGES, PAGES)
    pool = wire.StatePool.of(swa, ((0x300000, 0x400000), (0x500000, 0x600000)))
    decode_rank = wire.DecodeRank(rank, tp, rank * heads, (rank + 1) * heads)
    metadata = wire.frame_metadata(name.encode())
    return wire.Register.of(name, metadata, kv, "sglang", decode_rank, (pool,))


def window_want(pages: list[int], window: list[int]) -> WindowWant:
    packed = np.array(window, "<i4").tobytes()
    base = wire.Want.of(1, pages, 0, 0)
    return WindowWant(1, base.packed_dst_page_ids, 0, 0, packed_dst_window_pages=packed)


def test_window_slots_are_the_prompts_last_pages() -> None:
    """A window of 2 pages of a 3-page prompt (pages 1, 2): a chunk of pages 0..1 keeps page
    1, into the window's first slot; the next chunk page 2, into its second."""
    kept, slots = window_slots(np.array([5, 3]), 3, 0, 2)
    assert kept.tolist() == [False, True] and slots.tolist() == [5]
    kept, slots = window_slots(np.array([5, 3]), 3, 2, 1)
    assert kept.tolist() == [True] and slots.tolist() == [3]


def test_a_rank_writes_its_head_of_the_full_layer_and_of_the_window() -> None:
    """Rank 1 of 2 (head 1) into rank 1 of a decode of attention TP 2 (whole pages): a
    10-token prompt (3 pages) in one chunk of our pages 3, 4, 6; the window (its last 2
    pages) into SWA pages 5 and 2."""
    agent = TableAgent()
    backend = RankBackend(agent, RankPlace(1, 2, 2), ours(), 5.0, FakeClock(0.0))
    backend.add_peer(swa_register("d-0", 0, 2))  # head 0: rank 0's to write
    backend.add_peer(swa_register("d-1", 1, 2))
    sender = backend.create_sender(1, "r1", 10)
    sender.bind(["d-0", "d-1"], [window_want([1, 2, 7], [5, 2])] * 2)
    sender.send_pages([3, 4, 6], 0)
    full, window = agent.posted
    assert full[1] == [3, 4, 6, 11, 12, 14] and full[2] == [1, 2, 7, 9, 10, 15]
    assert window[1] == [4, 6, 12, 14, 20, 22, 28, 30]  # 4 planes of 8 pages: our 2 sliding
    assert window[2] == [5, 2, 11, 8, 17, 14, 23, 20]  # 4 planes of 6 SWA pages
    tables = dict((name, table) for name, table in agent.tables if name != "NIXL_INIT_AGENT")
    assert [row[0] for row in tables["d-1"]] == [0x300000, 0x400000, 0x500000, 0x600000]
    local = [t for name, t in agent.tables if name == "NIXL_INIT_AGENT"]
    step = ours().layout.region_bytes
    assert [row[0] for row in local[0]] == [BASE + step, BASE + 4 * step]  # full layer 1
    assert [row[0] for row in local[1]] == [BASE + i * step for i in (0, 2, 3, 5)]
    for handle in range(2):
        agent.states[handle] = "DONE"
    sender.send_aux(0)
    assert sender.poll() is KVPoll.SUCCESS


def test_a_decode_rank_of_every_head_gets_token_runs_of_this_ranks_head() -> None:
    """Into a decode of attention TP 1 (2 heads): head 1 at offset 1 of each token."""
    agent = TableAgent()
    backend = RankBackend(agent, RankPlace(1, 2, 2), ours(), 5.0, FakeClock(0.0))
    backend.add_peer(swa_register("d", 0, 1))
    sender = backend.create_sender(1, "r1", 10)
    sender.bind(["d"], [window_want([1, 2, 7], [5, 2])])
    sender.send_pages([6], 2)  # the last page only: window slot 2
    full, window = agent.posted
    assert full[2] == [4 * 7 + t for t in range(4)] + [4 * 15 + t for t in range(4)]
    assert window[2][:4] == [4 * 2 + t for t in range(4)] and len(window[2]) == 16
    remote = [t for name, t in agent.tables if name == "d"]
    swa_bases = (0x300000, 0x400000, 0x500000, 0x600000)
    assert [row[:2] for row in remote[1]] == [[a + 16, 16] for a in swa_bases]


def test_a_window_want_into_a_decode_rank_without_the_pool_fails_the_room() -> None:
    agent = TableAgent()
    backend = RankBackend(agent, RankPlace(0, 2, 2), ours(), 5.0, FakeClock(0.0))
    plain = swa_register("d", 0, 2)  # its every layer in its KV list: no SWA pool
    backend.add_peer(wire.Register.of("d", plain.metadata, ours(), "sglang", plain.tp))
    sender = backend.create_sender(1, "r1", 10)
    sender.bind(["d"], [window_want([1, 2, 7], [5, 2])])
    sender.send_pages([3, 4, 6], 0)
    assert sender.poll() is KVPoll.FAILED
    assert "registered no hybrid SWA pool" in str(sender.failure_reason())


def test_the_mirror_carries_a_window_want_whole() -> None:
    want = window_want([1, 2, 7], [5, 2])
    bind = MirrorOp("bind", 1, agent_names=["d"], wants=[want, wire.Want.of(1, [1], 0, 0)])
    [op] = decode_step(encode_step(None, [bind])).ops
    assert op.wants[0] == want and isinstance(op.wants[0], WindowWant)
    assert type(op.wants[1]) is wire.Want
