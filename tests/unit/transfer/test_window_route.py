"""A windowed sliding pool's push into a decode holding every layer (``push.window_route``,
the native decode): each full layer's pages whole, each sliding layer's window pages read
from the request's sliding pages into the decode's pages of the same positions; the native
desk routes a decode of any TP size so (a decode rank taking a head slice through token-run
lists, page_size descriptors a page on both sides) and refuses a decode with a draft pool,
counted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.headplan import slice_table
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.push.window_route import (
    FullPoolWindow,
    chunk_writes,
    full_pool_route,
    local_offsets,
    token_runs,
)
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import BootstrapLimits
from tests.unit.transfer.test_native_desk_tp import DESCRIBED, OUR_REGIONS, OURS, Desk
from tests.unit.transfer.test_native_draft import theirs

GIVEN = r"^a windowed sliding pool's pages were not given with the chunk$"
HELD = r"^a window page of the sliding pool is not held$"
ONLY = r"^FullPoolWindow: a route of a windowed sliding pool only$"
# layers 0 and 2 slide (their own 5 pages), layer 1 is full (8 pages); a decode keeps 7
LAYERS = SlidingLayers((0, 2), 3, 7, pool_pages=5)


def want(num_cached_tokens: int = 0) -> wire.Want:
    return wire.Want(1, b"", 0, num_cached_tokens)


def test_offsets_give_the_sliding_layers_their_own_page_count() -> None:
    offsets = local_offsets(LAYERS, 8)
    assert offsets.tolist() == [0, 5, 13, 18, 23, 31] and offsets.dtype == np.int32  # K, V
    plain = dataclasses.replace(LAYERS, pool_pages=0)
    assert local_offsets(plain, 8).tolist() == [0, 8, 16, 24, 32, 40]


def test_full_layers_send_every_page_and_sliding_layers_their_window() -> None:
    route = FullPoolWindow(LAYERS, 8, 10, 4)
    src, dst = np.arange(5), np.array([5, 6, 7, 8, 9])
    sliding = np.array([-1, -1, -1, 2, 0])  # 20 tokens: the window [13, 20) is pages 3, 4
    full, part = route.writes(want(), 20, src, dst, 0, sliding)
    assert full.local.tolist() == [5, 6, 7, 8, 9, 23, 24, 25, 26, 27]  # K1, V1 of pages 0-4
    assert full.remote.tolist() == [15, 16, 17, 18, 19, 45, 46, 47, 48, 49]
    assert part.local.tolist() == [2, 0, 15, 13, 20, 18, 33, 31]  # K0 K2 V0 V2, sliding pages
    assert part.remote.tolist() == [8, 9, 28, 29, 38, 39, 58, 59]  # the decode's pages 3, 4
    assert full.is_state is False and part.is_state is False and route.check(want(), 20) is None
    assert {str(a.dtype) for a in (full.local, full.remote, part.local, part.remote)} == {"int32"}
    with pytest.raises(ValueError, match=ONLY):
        FullPoolWindow(dataclasses.replace(LAYERS, pool_pages=0), 8, 10, 4)


def test_a_later_chunk_and_a_prefix_move_the_window() -> None:
    route = FullPoolWindow(LAYERS, 8, 10, 4)
    _, part = route.writes(want(16), 20, np.array([4]), np.array([9]), 4, np.array([3]))
    assert part.local.tolist() == [3, 16, 21, 34] and part.remote.tolist() == [9, 29, 39, 59]
    _, none = route.writes(want(), 20, np.array([1]), np.array([2]), 1, np.array([-1]))
    assert none.local.size == 0 and none.remote.size == 0  # before the window: not sent


@pytest.mark.parametrize(
    ("sliding", "why"),
    [(None, GIVEN), (np.array([0]), GIVEN), (np.array([-1, 1]), HELD)],
)
def test_a_window_page_missing_from_the_sliding_pool_is_an_error(
    sliding: np.ndarray | None, why: str
) -> None:
    route = FullPoolWindow(LAYERS, 8, 10, 4)
    with pytest.raises(ValueError, match=why):
        route.writes(want(), 8, np.arange(2), np.arange(2), 0, sliding)


def test_a_head_slice_sends_the_same_pages_as_token_runs() -> None:
    whole = FullPoolWindow(LAYERS, 8, 10, 4)
    runs = FullPoolWindow(LAYERS, 8, 10, 4, runs=4)
    args = (want(), 20, np.arange(5), np.array([5, 6, 7, 8, 9]), 0, np.array([-1, -1, -1, 2, 0]))
    for page, run in zip(whole.writes(*args), runs.writes(*args), strict=True):
        for pages, tokens in ((page.local, run.local), (page.remote, run.remote)):
            expected = [4 * p + t for p in pages.tolist() for t in range(4)]
            assert tokens.tolist() == expected and tokens.dtype == np.int32
    assert token_runs(np.array([3, 1], np.int32), 1).tolist() == [3, 1]
    assert token_runs(np.array([3, 1], np.int32), 2).tolist() == [6, 7, 2, 3]
    with pytest.raises(ValueError, match="3 runs a page of 4 tokens"):
        FullPoolWindow(LAYERS, 8, 10, 4, runs=3)


def test_the_route_of_a_decode_rank_is_whole_pages_or_token_runs() -> None:
    assert full_pool_route(None, 8, 10, 4, True) is None
    assert full_pool_route(dataclasses.replace(LAYERS, pool_pages=0), 8, 10, 4, True) is None
    args = (want(), 20, np.array([1]), np.array([2]), 4, np.array([3]))  # in the window
    whole, runs = full_pool_route(LAYERS, 8, 10, 4, True), full_pool_route(LAYERS, 8, 10, 4, False)
    assert whole is not None and runs is not None
    for page, run in zip(whole.writes(*args), runs.writes(*args), strict=True):
        assert run.local.tolist() == token_runs(page.local, 4).tolist() != page.local.tolist()
        assert run.remote.tolist() == token_runs(page.remote, 4).tolist()


def test_a_chunks_writes_skip_the_pages_the_decode_holds() -> None:
    route = FullPoolWindow(LAYERS, 8, 10, 4)
    chunk = ([6, 7, 4, 5], 2, [-1, -1, 1, 3])  # prompt pages 2..5 of 24 tokens, 2 held
    full, part = chunk_writes(route, want(16), 24, chunk, np.array([4, 5]), np.array([0, 1]))
    assert full.local.tolist() == [9, 10, 27, 28] and full.remote.tolist() == [10, 11, 40, 41]
    assert part.local.tolist() == [1, 3, 14, 16, 19, 21, 32, 34]  # pages 4, 5: sliding 1, 3
    assert part.remote.tolist() == [0, 1, 20, 21, 30, 31, 50, 51]
    with pytest.raises(ValueError, match=GIVEN):
        chunk_writes(route, want(16), 24, (chunk[0], 2, []), np.array([4, 5]), np.array([0, 1]))


def test_a_windowed_pools_token_runs_give_each_plane_its_own_page_count() -> None:
    regions = dataclasses.replace(OUR_REGIONS, layer_pages=(3, 16))  # layer 0 slides
    table = slice_table(regions, 1, 2)
    assert table[:, 4].tolist() == [12, 64, 12, 64]  # tokens of K0 K1 V0 V1
    assert table[:, 0].tolist() == [a + 32 for a in (1 << 20, 2 << 20, 3 << 20, 4 << 20)]
    whole = slice_table(OUR_REGIONS, 1, 2)
    assert whole[:, 4].tolist() == [64] * 4


class WindowedDesk(Desk):
    def __init__(self) -> None:
        super().__init__()
        layers = SlidingLayers((0,), 2, 7, pool_pages=3)  # OURS: 2 layers, 16 pages
        regions = dataclasses.replace(OUR_REGIONS, layer_pages=(3, 16))
        args = (self.hub, self.server, self.agent, OURS, BootstrapLimits(), DESCRIBED)
        self.desk = BootstrapDesk(*args, regions=regions, sliding=layers)  # type: ignore[arg-type]


def test_the_desk_routes_decodes_of_any_tp_and_refuses_a_draft_pool() -> None:
    d = WindowedDesk()
    assert d.register(b"tp1", 4).is_ok
    route = d.hub.peers[b"tp1"].route
    assert isinstance(route, FullPoolWindow)
    full, _ = route.writes(want(), 4, np.array([1]), np.array([2]), 0, np.array([0]))
    assert full.local.tolist() == [4, 23] and full.remote.tolist() == [34, 98]  # K1 V1 whole
    assert d.register(b"rank-1", 2, wire.DecodeRank(1, 2, 2, 4)).is_ok
    peer = d.hub.peers[b"rank-1"]
    assert peer.head_slice is not None and isinstance(peer.route, FullPoolWindow)
    assert list(d.hub.ctx.pages.sliced) == [(2, 2)]  # our token runs of heads 2..3
    full, _ = peer.route.writes(want(), 4, np.array([1]), np.array([2]), 0, np.array([0]))
    assert full.local.tolist() == [16, 17, 18, 19, 92, 93, 94, 95]  # K1 V1, token by token
    assert full.remote.tolist() == [136, 137, 138, 139, 392, 393, 394, 395]
    assert d.hub.counter.counts == {}
    layout = dataclasses.replace(OURS, num_pages=32)
    regions = KVRegions(layout, (1 << 30, 2 << 30), (3 << 30, 4 << 30), "cpu", 5 << 30, 4)
    metadata = wire.frame_metadata(b"drafty")
    msg = wire.Register.of("drafty", metadata, regions, layout.compat_hash(), draft=theirs())
    d.desk.dispatch(b"drafty", msg)
    reply = d.server.sent[-1][1]
    assert not reply.is_ok and reply.reason == DRAFT_REFUSED, reply
    assert b"drafty" not in d.hub.peers
    assert d.hub.counter.counts == {"unsupported": 1}
    assert "drafty" not in d.agent.added  # refused before NIXL saw it


DRAFT_REFUSED = (
    "a decode with a draft pool: this worker keeps its sliding layers' window only "
    "(cache.sliding_pool windowed) and sends it to decodes without a draft; start the worker "
    "with sliding_pool full"
)


def test_a_desk_without_a_windowed_pool_routes_nothing() -> None:
    d = Desk()
    assert d.register(b"tp1", 4).is_ok and d.hub.peers[b"tp1"].route is None


def test_a_sliding_model_in_the_full_pool_takes_a_draft_decode() -> None:
    d = Desk()
    layers = SlidingLayers((0,), 2, 7)  # pool_pages 0: the sliding layers share the pool
    args = (d.hub, d.server, d.agent, OURS, BootstrapLimits(), DESCRIBED)
    d.desk = BootstrapDesk(*args, regions=OUR_REGIONS, sliding=layers)  # type: ignore[arg-type]
    layout = dataclasses.replace(OURS, num_pages=32)
    regions = KVRegions(layout, (1 << 30, 2 << 30), (3 << 30, 4 << 30), "cpu", 5 << 30, 4)
    msg = wire.Register.of("drafty", wire.frame_metadata(b"drafty"), regions,
                           layout.compat_hash(), draft=theirs())  # fmt: skip
    d.desk.dispatch(b"drafty", msg)
    assert d.server.sent[-1][1].is_ok  # a worker without a draft writes the target's alone
    assert d.hub.peers[b"drafty"].route is None and d.hub.counter.counts == {}
