"""Prefill ranks of a TP group write their head slices into decode ranks of another TP size
over real NIXL (UCX, one agent per rank, in this process): p = 2 into d = 1 and d = 2, p = 1
into d = 2 and d = 4, and a replicated head. Each prefill rank's pool holds only its heads of
one known KV tensor; every decode rank must end with exactly its heads of the written pages,
byte for byte, and nothing else touched. No engine, no sockets: the seam under the group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout
from prefill_worker.transfer.nixl.agent import (
    deregister_regions,
    make_agent,
    register_regions,
)
from prefill_worker.transfer.nixl.rank_writer import RankPlace, RankWriter
from tests.integration.transfer.peers import PoolSpec, layer_page, regions_over
from tests.polling import wait_until

NUM_LAYERS, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 2, 8, 4, 6
SRC_PAGES, DST_PAGES = np.array([5, 0, 3]), np.array([1, 4, 2])


class Rank:
    """One rank's agent over one pool of ``num_heads`` heads per token."""

    def __init__(self, name: str, num_heads: int, kind: str) -> None:
        layout = KVLayout(NUM_LAYERS, num_heads, HEAD_DIM, "float32", PAGE_SIZE, NUM_PAGES, kind)
        self.spec = PoolSpec(layout, num_aux_rows=1)
        self.buf = np.zeros(self.spec.nbytes, dtype=np.uint8)
        self.regions = regions_over(self.spec, self.buf)
        self.agent = make_agent(name, ["UCX"])
        self.registration = register_regions(self.agent, self.regions)

    def page(self, layer: int, kv: int, page: int) -> np.ndarray:
        return layer_page(self.buf, self.spec.layout, layer, kv, page)

    def close(self) -> None:
        deregister_regions(self.agent, self.registration)


def _fill(rank: Rank, full: np.ndarray, heads: range) -> None:
    for layer, kv, page in np.ndindex(NUM_LAYERS, 2, NUM_PAGES):
        local = np.ascontiguousarray(full[layer, kv, page, :, heads.start : heads.stop])
        rank.page(layer, kv, page)[:] = local.view(np.uint8).reshape(-1)


@pytest.fixture
def ranks() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for thing in reversed(made):
        thing.close()


@pytest.mark.parametrize(
    ("num_kv_heads", "src_tp", "dst_tp"),
    [(4, 2, 1), (4, 2, 2), (4, 1, 2), (4, 1, 4), (1, 2, 1)],
)
def test_each_decode_rank_gets_exactly_its_heads(
    num_kv_heads: int, src_tp: int, dst_tp: int, pool_layout: str, ranks: list[Any]
) -> None:
    full = np.random.default_rng(7).standard_normal(
        (NUM_LAYERS, 2, NUM_PAGES, PAGE_SIZE, num_kv_heads, HEAD_DIM), dtype=np.float32
    )
    decode = []
    for j in range(dst_tp):
        heads = kv_head_range(num_kv_heads, j, dst_tp)
        decode.append(Rank(f"d{dst_tp}-{j}", len(heads), LAYER_MAJOR))
        ranks.append(decode[-1])
    handles, num_bytes = [], 0
    for r in range(src_tp):
        place = RankPlace(r, src_tp, num_kv_heads)
        prefill = Rank(f"p{src_tp}-{r}", len(place.heads), pool_layout)
        ranks.append(prefill)
        _fill(prefill, full, place.heads)
        writer = RankWriter(prefill.agent, place, prefill.regions)
        ranks.insert(ranks.index(prefill) + 1, writer)  # closed before its rank
        for j, rank in enumerate(decode):
            name = writer.add_peer(rank.agent.get_agent_metadata(), rank.regions, j, dst_tp)
            if name is not None:
                handle, size = writer.post(name, SRC_PAGES, DST_PAGES, b"")
                handles.append((prefill.agent, handle))
                num_bytes += size

    def landed() -> bool:
        for rank in decode:  # a target's agent progresses only when polled
            rank.agent.get_new_notifs()
        return all(agent.check_xfer_state(h) == "DONE" for agent, h in handles)

    wait_until(landed, 10.0, "every rank's writes")
    for agent, handle in handles:
        agent.release_xfer_handle(handle)
    # The writes say they cover every head of every decode rank, K and V of each layer of
    # each written page: what the decode ranks hold.
    head_page_bytes = 2 * NUM_LAYERS * PAGE_SIZE * HEAD_DIM * 4
    heads = sum(len(kv_head_range(num_kv_heads, j, dst_tp)) for j in range(dst_tp))
    assert num_bytes == len(SRC_PAGES) * heads * head_page_bytes
    for j, rank in enumerate(decode):
        heads = kv_head_range(num_kv_heads, j, dst_tp)
        for layer, kv, page in np.ndindex(NUM_LAYERS, 2, NUM_PAGES):
            got = rank.page(layer, kv, page)
            if page not in DST_PAGES:
                assert not got.any(), (j, layer, kv, page)
                continue
            src_page = SRC_PAGES[list(DST_PAGES).index(page)]
            want = np.ascontiguousarray(full[layer, kv, src_page, :, heads.start : heads.stop])
            assert np.array_equal(got, want.view(np.uint8).reshape(-1)), (j, layer, kv, page)


def test_a_decode_rank_this_rank_does_not_feed_is_not_added(ranks: list[Any]) -> None:
    prefill = Rank("p2-only", 2, LAYER_MAJOR)
    ranks.append(prefill)
    writer = RankWriter(prefill.agent, RankPlace(0, 2, 4), prefill.regions)
    ranks.append(writer)
    other = Rank("d2-1-only", 2, LAYER_MAJOR)
    ranks.append(other)
    assert writer.add_peer(other.agent.get_agent_metadata(), other.regions, 1, 2) is None
    with pytest.raises(ValueError, match="holds 4 of 4 KV heads; its pool has 2"):
        RankWriter(prefill.agent, RankPlace(0, 1, 4), prefill.regions)
