"""A windowed sliding pool's push into a decode holding every layer (``push.window_route``,
the native decode): each full layer's pages whole, each sliding layer's window pages read
from the request's sliding pages into the decode's pages of the same positions; the native
desk routes a TP-1 decode so and refuses a decode rank taking head slices, counted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.push.window_route import FullPoolWindow, local_offsets
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import BootstrapLimits
from tests.unit.transfer.test_native_desk_tp import DESCRIBED, OUR_REGIONS, OURS, Desk

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
    assert not full.is_state and not part.is_state and route.check(want(), 20) is None
    assert {str(a.dtype) for a in (full.local, full.remote, part.local, part.remote)} == {"int32"}
    with pytest.raises(ValueError, match="windowed sliding pool only"):
        FullPoolWindow(dataclasses.replace(LAYERS, pool_pages=0), 8, 10, 4)


def test_a_later_chunk_and_a_prefix_move_the_window() -> None:
    route = FullPoolWindow(LAYERS, 8, 10, 4)
    _, part = route.writes(want(16), 20, np.array([4]), np.array([9]), 4, np.array([3]))
    assert part.local.tolist() == [3, 16, 21, 34] and part.remote.tolist() == [9, 29, 39, 59]
    _, none = route.writes(want(), 20, np.array([1]), np.array([2]), 1, np.array([-1]))
    assert none.local.size == 0 and none.remote.size == 0  # before the window: not sent


@pytest.mark.parametrize(
    ("sliding", "why"),
    [(None, "were not given"), (np.array([0]), "were not given"), (np.array([-1, 1]), "not held")],
)
def test_a_window_page_missing_from_the_sliding_pool_is_an_error(
    sliding: np.ndarray | None, why: str
) -> None:
    route = FullPoolWindow(LAYERS, 8, 10, 4)
    with pytest.raises(ValueError, match=why):
        route.writes(want(), 8, np.arange(2), np.arange(2), 0, sliding)


class WindowedDesk(Desk):
    def __init__(self) -> None:
        super().__init__()
        layers = SlidingLayers((0,), 2, 7, pool_pages=3)  # OURS: 2 layers, 16 pages
        regions = dataclasses.replace(OUR_REGIONS, layer_pages=(3, 16))
        args = (self.hub, self.server, self.agent, OURS, BootstrapLimits(), DESCRIBED)
        self.desk = BootstrapDesk(*args, regions=regions, sliding=layers)  # type: ignore[arg-type]


def test_the_desk_routes_a_tp1_decode_and_refuses_a_decode_rank() -> None:
    d = WindowedDesk()
    assert d.register(b"tp1", 4).is_ok
    assert isinstance(d.hub.peers[b"tp1"].route, FullPoolWindow)
    reply = d.register(b"rank-1", 2, wire.DecodeRank(1, 2, 2, 4))
    assert not reply.is_ok and "head slices" in reply.reason, reply.reason
    assert "sliding_pool windowed" in reply.reason and b"rank-1" not in d.hub.peers
    assert d.hub.counter.counts == {"unsupported": 1}


def test_a_desk_without_a_windowed_pool_routes_nothing() -> None:
    d = Desk()
    assert d.register(b"tp1", 4).is_ok and d.hub.peers[b"tp1"].route is None
