"""An SGLang decode with a hybrid SWA pool (``sglang.swa``): its registration becomes a peer
whose KV list is the full layers and whose state pool is the sliding layers' SWA pool; each
page then goes in parts (full layers to the KV list, sliding layers' window pages to the SWA
pool); anything else it registers or asks is refused with a reason that names it."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import StateComponent, StateRegions, StateTensor
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.headplan import HeadSlice
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.nixl.state_lists import StateLists
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest, parse
from prefill_worker.transfer.sglang.swa import (
    SWA_KIND,
    WindowRoute,
    WindowWant,
    accept_window,
    window_want,
)
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.validate import BootstrapLimits, Refusal, RejectReason
from tests.unit.transfer import test_push_sender
from tests.unit.transfer.test_sglang_desk import FakeAgent
from tests.unit.transfer.test_sglang_desk import Rig as DeskRig
from tests.unit.transfer.test_sglang_frames_pins import changed, packed_lists

# The desk's worker: 3 layers, 0 and 2 sliding; pages of 4 tokens of 2 heads x 16 fp32 (512 B,
# the captured registration's page).
LAYOUT = KVLayout(3, 2, 16, "float32", 4, 64)
SLIDING = SlidingLayers((0, 2), 3, 5)
SWA_PTRS = [0x10000, 0x20000, 0x30000, 0x40000]  # K of sliding layers 0, 2; then V


def swa_registration(**frames_at: bytes) -> Registration:
    """SGLang 0.5.23's registration from a decode of this model with hybrid SWA memory: its
    KV list the full layer (K, V), its SWA pool 4 buffers of 9 pages."""
    full = [0x1000, 0x2000]
    state = {
        "f6": struct.pack("<2Q", *full),
        "f18": b"DRAM,DRAM",
        "f19": struct.pack("<2Q", 512, 512),
        "f8": packed_lists(SWA_PTRS, fmt="Q"),
        "f13": packed_lists([512] * 4, fmt="I"),
        "f14": packed_lists([], fmt="I"),
        "f20": packed_lists([], fmt="I"),
        "f24": packed_lists([512 * 9] * 4, fmt="Q"),
    }
    reg = parse(changed("registration", **{**state, **frames_at}))
    assert isinstance(reg, Registration)
    return reg


def test_a_swa_registration_is_its_full_layers_and_a_pool_of_window_pages() -> None:
    pool = accept_window(swa_registration(), LAYOUT, SLIDING, BootstrapLimits())
    assert not isinstance(pool, Refusal)
    assert pool.layout.num_layers == 1 and not pool.registration.has_state
    assert pool.registration.kv_ptrs == (0x1000, 0x2000)
    component = pool.swa.component
    assert (component.kind, component.layer_ids, component.num_items) == (SWA_KIND, (0, 2), 9)
    assert [t.item_bytes for t in component.tensors] == [512, 512]
    assert pool.swa.base_addrs == ((0x10000, 0x20000), (0x30000, 0x40000))
    assert pool.swa.device == "cpu"


def test_a_decode_rank_of_attention_tp_2_holds_its_heads_of_each_swa_page() -> None:
    """Rank 1 of 2: one head of each page, its SWA pool's pages of that head (256 B)."""
    sizes = {"f13": packed_lists([256] * 4, fmt="I"), "f24": packed_lists([256 * 9] * 4, fmt="Q")}
    reg = swa_registration(f10=b"2", f11=b"1", **sizes)
    pool = accept_window(reg, LAYOUT, SLIDING, BootstrapLimits())
    assert not isinstance(pool, Refusal), pool
    component = pool.swa.component
    assert component.num_items == 9
    assert [(t.item_shape, t.item_bytes) for t in component.tensors] == [((4, 1, 16), 256)] * 2


def test_a_windowed_worker_refuses_a_decode_rank_of_other_heads() -> None:
    """A decode of attention TP 2 at a windowed worker of TP 1 (rank 1 holds head 1 of our
    2): its window's token runs would come from the windowed pool, not built: refused,
    counted, before NIXL hears of it."""
    agent = ListingAgent()
    rig = DeskRig(layout=LAYOUT, sliding=dataclasses.replace(SLIDING, pool_pages=8), agent=agent)
    sizes = {"f13": packed_lists([256] * 4, fmt="I"), "f24": packed_lists([256 * 9] * 4, fmt="Q")}
    kv = {"f19": struct.pack("<2Q", 256, 256), "f12": b"256"}  # its KV list: one head too
    rig.send(swa_registration(f10=b"2", f11=b"1", **sizes, **kv))
    assert not rig.peers and rig.rejects == ["unsupported"] and not agent.lists
    rig.send(request([8, 4]))
    assert b"windowed sliding pool (its heads' token runs" in rig.replies.sent[-1][1][4]


@pytest.mark.parametrize(
    ("frames_at", "reason", "words"),
    [
        (  # a rank of attention TP 2 holds one head of each page: 256 B
            {"f10": b"2", "f11": b"0"},
            RejectReason.LAYOUT_MISMATCH,
            "decode SWA page is [512] bytes; this worker's is 256",
        ),
        (
            {
                "f8": packed_lists(SWA_PTRS, [1], fmt="Q"),
                "f13": packed_lists([512] * 4, [8], fmt="I"),
                "f14": b"",
                "f20": b"",
                "f24": b"",
            },
            RejectReason.UNSUPPORTED,
            "registered 2 state components",
        ),
        (
            {"f14": packed_lists([4], fmt="I")},
            RejectReason.UNSUPPORTED,
            "not a hybrid SWA pool",
        ),
        (
            {"f20": packed_lists([0], fmt="I")},
            RejectReason.UNSUPPORTED,
            "not a hybrid SWA pool",
        ),
        (
            {
                "f8": packed_lists(SWA_PTRS[:2], fmt="Q"),
                "f13": packed_lists([512] * 2, fmt="I"),
                "f24": packed_lists([512 * 9] * 2, fmt="Q"),
            },
            RejectReason.LAYOUT_MISMATCH,
            "registered 2 SWA buffers; this model has 2 sliding layers (4",
        ),
        (
            {"f13": packed_lists([256] * 4, fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "decode SWA page is [256] bytes; this worker's is 512",
        ),
        ({"f24": b""}, RejectReason.UNSUPPORTED, "state_data_lens, sent from SGLang 0.5.23"),
        (
            {"f24": packed_lists([512 * 9] * 3 + [512], fmt="Q")},
            RejectReason.UNSUPPORTED,
            "without one size for all",
        ),
        ({"f24": packed_lists([511] * 4, fmt="Q")}, RejectReason.TOO_LARGE, "SWA pool of 0 pages"),
        (
            {"f8": packed_lists([0, 1, 2, 3], fmt="Q")},
            RejectReason.BAD_ADDRESS,
            "SWA region",
        ),
    ],
)
def test_what_a_swa_pool_must_be(
    frames_at: dict[str, bytes], reason: RejectReason, words: str
) -> None:
    refusal = accept_window(swa_registration(**frames_at), LAYOUT, SLIDING, BootstrapLimits())
    assert isinstance(refusal, Refusal), refusal
    assert refusal.reason is reason and words in refusal.message, refusal.message


def test_a_pool_past_the_page_bound_is_refused() -> None:
    limits = dataclasses.replace(BootstrapLimits(), max_peer_pages=8)
    refusal = accept_window(swa_registration(), LAYOUT, SLIDING, limits)
    assert isinstance(refusal, Refusal) and refusal.reason is RejectReason.TOO_LARGE
    assert "SWA pool of 9 pages; this worker takes 1 to 8" in refusal.message
    at_bound = dataclasses.replace(limits, max_peer_pages=9)
    assert not isinstance(accept_window(swa_registration(), LAYOUT, SLIDING, at_bound), Refusal)


def request(*lists: list[int], prefix: int = 0) -> TransferRequest:
    req = parse(changed("request", f8=packed_lists(*lists), f9=b"%d" % prefix))
    assert isinstance(req, TransferRequest)
    return req


def test_the_window_pages_ride_with_the_want() -> None:
    want = window_want(request([9, 4]))
    assert isinstance(want, WindowWant)
    assert list(want.dst_window_pages) == [9, 4]
    assert list(want.dst_page_ids) == [3, 5, 7] and want.num_cached_tokens == 0
    refusal = window_want(request([9], [4]))
    assert isinstance(refusal, Refusal) and "names 2 state index lists" in refusal.message


# -- through the desk -------------------------------------------------------------------


class Listed:
    """A prepared list that knows whether it was released."""

    def __init__(self, name: str, table: np.ndarray) -> None:
        self.name, self.table, self.is_released = name, table, False

    def release(self) -> None:
        self.is_released = True


class ListingAgent(FakeAgent):
    """Keeps each list it prepares; refuses the ``fail_at``-th (0: none)."""

    def __init__(self, fail_at: int = 0) -> None:
        super().__init__()
        self.lists: list[Listed] = []
        self._fail_at = fail_at

    def prep_xfer_dlist(self, name: str, table: Any, mem_type: str) -> Listed:  # type: ignore[override]
        if len(self.lists) + 1 == self._fail_at:
            raise NIXL_ERRORS[0]("no such memory")
        self.lists.append(Listed(name, np.asarray(table)))
        return self.lists[-1]


def desk_rig(sliding: SlidingLayers | None = SLIDING, agent: FakeAgent | None = None) -> DeskRig:
    return DeskRig(layout=LAYOUT, sliding=sliding, agent=agent)


def test_the_desk_registers_a_swa_decode_with_its_state_pool_and_route() -> None:
    rig = desk_rig()
    reg = swa_registration()
    rig.send(reg)
    [peer] = rig.peers.values()
    assert peer.regions.layout.num_layers == 1 and peer.regions.k_base_addrs == (0x1000,)
    assert peer.state is not None and peer.state.regions.component.kind == SWA_KIND
    assert isinstance(peer.route, WindowRoute)
    rig.send(request([8, 4]))  # 12 tokens in 3 pages: the window is pages 1 and 2 (from 7)
    sender = rig.hub.create_sender(1234, "req", 12)
    assert sender.poll() is KVPoll.READY, sender.failure_reason()
    assert not rig.rejects
    rig.send(request([8], [4]))  # two index lists: that room is refused
    rig.hub.drain()
    assert rig.rejects == ["unsupported"]


def test_the_swa_pool_is_prepared_for_the_decode_agent() -> None:
    agent = ListingAgent()
    rig = desk_rig(agent=agent)
    reg = swa_registration()
    rig.send(reg)
    [peer] = rig.peers.values()
    kv, aux, swa = agent.lists
    assert {kv.name, aux.name, swa.name} == {reg.agent_name}
    assert peer.state is not None and peer.state.prepped is swa
    # one strided row per buffer: its address, a page, the device, a page on, 9 pages
    assert swa.table.tolist() == [[a, 512, 0, 512, 9] for a in SWA_PTRS]


def test_a_tp_2_leader_writes_its_head_of_the_swa_pool_and_mirrors_the_pool() -> None:
    """The leader of a worker of TP 2 (rank 0: head 0 of 2, every layer) and a decode of
    attention TP 1 (both heads): its SWA pool is listed as token runs of head 0 (64 B a
    token, 128 B apart), ours of every layer; the mirrored `register` names the pool, so the
    other rank writes head 1 of the window too."""
    ours = KVRegions(
        dataclasses.replace(LAYOUT, num_kv_heads=1),
        (1 << 20, 2 << 20, 3 << 20),
        (4 << 20, 5 << 20, 6 << 20),
        "cpu",
        0,
        0,
    )
    agent = ListingAgent()
    rig = DeskRig(layout=ours.layout, regions=ours, sliding=SLIDING, agent=agent)
    rig.desk.lead(2, LAYOUT.num_kv_heads)
    rig.send(swa_registration())
    [peer] = rig.peers.values()
    assert peer.head_slice is not None and peer.head_slice.num_heads == 1
    local, kv, _, swa = agent.lists
    assert local.name == "NIXL_INIT_AGENT" and len(local.table) == 6  # our 3 layers' K, V
    tokens = peer.regions.layout.num_pages * 4
    assert kv.table.tolist() == [[a, 64, 0, 128, tokens] for a in (0x1000, 0x2000)]
    assert peer.state is not None and peer.state.prepped is swa
    assert swa.table.tolist() == [[a, 64, 0, 128, 9 * 4] for a in SWA_PTRS]
    held = peer.registration
    assert held is not None and held.tp == wire.DecodeRank(0, 1, 0, 2)
    assert held.regions.layout.num_layers == 1  # its KV list: the full layer
    [pool] = held.state  # type: ignore[misc]
    assert (pool.kind, pool.layer_ids, pool.num_items) == (SWA_KIND, (0, 2), 9)
    assert pool.base_addrs == ((0x10000, 0x20000), (0x30000, 0x40000))


def test_a_swa_pool_nixl_cannot_address_refuses_the_decode() -> None:
    agent = ListingAgent(fail_at=3)  # the KV list, the aux rows, then the SWA pool's
    rig = desk_rig(agent=agent)
    rig.send(swa_registration())
    assert not rig.peers and rig.rejects == ["nixl_refused"]
    assert all(listed.is_released for listed in agent.lists) and len(agent.lists) == 2
    assert not agent.remote


def test_a_refused_swa_decode_hears_why_on_its_request() -> None:
    rig = desk_rig()
    rig.send(swa_registration(f24=b""))  # an older decode: its SWA pool's size unknown
    assert not rig.peers and rig.rejects == ["unsupported"]
    rig.send(request([8, 4]))
    reason = rig.replies.sent[-1][1][4].decode()
    assert reason.startswith("registration refused: the decode's SWA buffers come without")


def test_a_model_without_sliding_layers_refuses_the_swa_decode() -> None:
    rig = desk_rig(None)
    rig.send(swa_registration())
    assert not rig.peers and rig.rejects == ["unsupported"]
    rig.send(request([9, 4]))
    assert b"registered state buffers (a hybrid model)" in rig.replies.sent[-1][1][4]


def test_a_dense_decode_of_a_sliding_model_is_a_full_pool() -> None:
    rig = desk_rig()
    reg = swa_registration(
        f6=struct.pack("<6Q", *range(0x1000, 0x7000, 0x1000)),
        f18=b"DRAM," * 5 + b"DRAM",
        f19=struct.pack("<6Q", *[512] * 6),
        f8=b"",
        f13=b"",
        f14=b"",
        f20=b"",
        f24=b"",
    )
    rig.send(reg)
    [peer] = rig.peers.values()
    assert peer.route is None and peer.state is None and peer.regions.layout.num_layers == 3


# -- the route, through a sender ----------------------------------------------------------


def test_a_page_goes_in_parts_full_layers_then_the_window() -> None:
    """2 layers (0 slides), pages of 4, a decode keeping 5 tokens: a 16-token prompt's window
    is pages 2 and 3 (tokens 11..15, from 8); its SWA pages 5 and 8 of 9."""
    rig = test_push_sender.Rig("sglang")
    swa = StateComponent(SWA_KIND, (0,), (StateTensor("k", (4, 1, 8), "float32", 128),) * 2, 9)
    rig.peer.state = StateLists(StateRegions(swa, ((100,), (200,)), "cpu"), "swa")
    rig.peer.route = WindowRoute(SlidingLayers((0,), 2, 5), 16, 16, 9, 4)
    sender = rig.hub.create_sender(7, "req-7", 16)
    pages, window = (np.array(p, "<i4").tobytes() for p in ([3, 4, 5, 6], [5, 8]))
    rig.hub.want(rig.peer, WindowWant(7, pages, 2, 0, packed_dst_window_pages=window))
    assert sender.poll() is KVPoll.READY, sender.failure_reason()
    sender.send_pages([0, 1], 0)  # before the window: the full layer only
    sender.send_pages([2, 3], 2)
    first, full, window = rig.agent.handles
    assert list(first.args[2]) == [16, 17, 48, 49] and list(first.args[4]) == [3, 4, 19, 20]
    _, local, local_idx, remote, remote_idx, _ = full.args
    assert (local, list(local_idx), list(remote_idx)) == ("kv", [18, 19, 50, 51], [5, 6, 21, 22])
    assert remote is rig.peer.lists.kv
    _, local, local_idx, remote, remote_idx, notif = window.args
    assert (local, remote, notif) == ("kv", "swa", b"")  # SGLang's decode hears KV_STATUS
    assert list(local_idx) == [2, 3, 34, 35] and list(remote_idx) == [5, 8, 14, 17]
    for i in range(3):
        rig.land(i)
    sender.progress()
    assert sender.transfer_stats().bytes == (4 + 4 + 4) * 128


def test_a_decode_rank_of_other_heads_gets_token_runs_of_both_parts() -> None:
    """The same chunk into a decode holding 4 heads of which ours are heads 2 and 3 (a TP-2
    worker's rank 1 into a decode of attention TP 1): each whole-page index i becomes the
    page's token runs 4i..4i+3, from our list of those heads' runs into the decode's (KV and
    SWA pool)."""
    rig = test_push_sender.Rig("sglang")
    swa = StateComponent(SWA_KIND, (0,), (StateTensor("k", (4, 4, 8), "float32", 512),) * 2, 9)
    rig.peer.state = StateLists(StateRegions(swa, ((100,), (200,)), "cpu"), "swa-runs")
    rig.peer.route = WindowRoute(SlidingLayers((0,), 2, 5), 16, 16, 9, 4, runs=4)
    rig.peer.head_slice = HeadSlice(1, 0, 0, 2, 2, 2, 4)
    object.__setattr__(rig.ctx.pages, "head_bytes", 32)  # one head of a token, fp32
    rig.ctx.pages.sliced[(0, 2)] = "ours-head"
    sender = rig.hub.create_sender(7, "req-7", 16)
    pages, window = (np.array(p, "<i4").tobytes() for p in ([3, 4, 5, 6], [5, 8]))
    rig.hub.want(rig.peer, WindowWant(7, pages, 2, 0, packed_dst_window_pages=window))
    sender.send_pages([2, 3], 2)
    full, part = rig.agent.handles
    runs = lambda *pages: [4 * p + t for p in pages for t in range(4)]  # noqa: E731
    _, local, local_idx, remote, remote_idx, _ = full.args
    assert (local, remote) == ("ours-head", rig.peer.lists.kv)
    assert list(local_idx) == runs(18, 19, 50, 51) and list(remote_idx) == runs(5, 6, 21, 22)
    _, local, local_idx, remote, remote_idx, _ = part.args
    assert (local, remote) == ("ours-head", "swa-runs")
    assert list(local_idx) == runs(2, 3, 34, 35) and list(remote_idx) == runs(5, 8, 14, 17)
    for i in range(2):
        rig.land(i)
    sender.progress()
    # 8 page-planes (2 pages: K and V of the full layer, then of the sliding one) x 4 tokens
    assert sender.transfer_stats().bytes == 2 * 4 * 4 * 2 * 32


@pytest.mark.parametrize(
    ("window", "why"),
    [
        (None, "names no SWA pages"),
        ([5], "names 1 SWA pages, the window needs 2"),
        ([5, 9], "SWA pages outside the decode's SWA pool of 9 pages"),
        ([-1, 5], "SWA pages outside"),
        ([5, 5], "repeat a page"),
    ],
)
def test_a_want_whose_window_does_not_fit_fails_the_room(
    window: list[int] | None, why: str
) -> None:
    rig = test_push_sender.Rig("sglang")
    rig.peer.route = WindowRoute(SlidingLayers((0,), 2, 5), 16, 16, 9, 4)
    sender = rig.hub.create_sender(7, "req-7", 16)
    want = wire.Want.of(7, [3, 4, 5, 6], 2, 0)
    if window is not None:
        packed = np.array(window, "<i4").tobytes()
        want = WindowWant(7, want.packed_dst_page_ids, 2, 0, packed_dst_window_pages=packed)
    rig.hub.want(rig.peer, want)
    assert sender.poll() is KVPoll.FAILED and why in str(sender.failure_reason())
    assert not rig.agent.handles


def test_a_model_whose_every_layer_slides_sends_only_the_window() -> None:
    rig = test_push_sender.Rig("sglang")
    swa = StateComponent(SWA_KIND, (0, 1), (StateTensor("k", (4, 1, 8), "float32", 128),) * 2, 9)
    rig.peer.state = StateLists(StateRegions(swa, ((100, 101), (200, 201)), "cpu"), "swa")
    rig.peer.route = WindowRoute(SlidingLayers((0, 1), 2, 5), 16, 16, 9, 4)
    sender = rig.hub.create_sender(7, "req-7", 16)
    pages, window = (np.array(p, "<i4").tobytes() for p in ([3, 4, 5, 6], [5, 8]))
    rig.hub.want(rig.peer, WindowWant(7, pages, 2, 0, packed_dst_window_pages=window))
    sender.send_pages([0, 1, 2, 3], 0)
    [write] = rig.agent.handles  # no full layer: nothing for the KV list
    assert write.args[3] == "swa" and list(write.args[2]) == [2, 3, 18, 19, 34, 35, 50, 51]


def windowed_rig() -> tuple[test_push_sender.Rig, object]:
    """The rig of ``test_a_page_goes_in_parts...`` from a windowed sliding pool of 6 pages:
    our list is K0 (6 pages), K1 (16), V0 (6), V1 (16), so regions start at 0, 6, 22, 28."""
    rig = test_push_sender.Rig("sglang")
    swa = StateComponent(SWA_KIND, (0,), (StateTensor("k", (4, 1, 8), "float32", 128),) * 2, 9)
    rig.peer.state = StateLists(StateRegions(swa, ((100,), (200,)), "cpu"), "swa")
    rig.peer.route = WindowRoute(SlidingLayers((0,), 2, 5, pool_pages=6), 16, 16, 9, 4)
    sender = rig.hub.create_sender(7, "req-7", 16)
    pages, window = (np.array(p, "<i4").tobytes() for p in ([3, 4, 5, 6], [5, 8]))
    rig.hub.want(rig.peer, WindowWant(7, pages, 2, 0, packed_dst_window_pages=window))
    assert sender.poll() is KVPoll.READY, sender.failure_reason()
    return rig, sender


def test_a_windowed_pool_sends_the_window_from_its_sliding_pages() -> None:
    rig, sender = windowed_rig()
    sender.send_pages([0, 1], 0, [-1, -1])  # fallen out of the window: not held, not sent
    sender.send_pages([2, 3], 2, [4, 1])  # the window's sliding pages
    first, full, window = rig.agent.handles
    assert list(first.args[2]) == [6, 7, 28, 29] and list(first.args[4]) == [3, 4, 19, 20]
    assert list(full.args[2]) == [8, 9, 30, 31] and list(full.args[4]) == [5, 6, 21, 22]
    _, local, local_idx, remote, remote_idx, _ = window.args
    assert (local, remote) == ("kv", "swa")
    assert list(local_idx) == [4, 1, 26, 23] and list(remote_idx) == [5, 8, 14, 17]


@pytest.mark.parametrize(("entries", "why"), [((), "were not given"), ((4, -1), "not held")])
def test_a_window_page_the_sliding_pool_lacks_fails_the_room(
    entries: tuple[int, ...], why: str
) -> None:
    rig, sender = windowed_rig()
    sender.send_pages([2, 3], 2, entries)
    assert sender.poll() is KVPoll.FAILED and why in str(sender.failure_reason())
    assert not rig.agent.handles  # not even the full layers' part


def test_a_windowed_worker_refuses_a_full_pool_decode() -> None:
    rig = desk_rig(dataclasses.replace(SLIDING, pool_pages=6))
    reg = swa_registration(
        f6=struct.pack("<6Q", *range(0x1000, 0x7000, 0x1000)),
        f18=b"DRAM," * 5 + b"DRAM",
        f19=struct.pack("<6Q", *[512] * 6),
        f8=b"",
        f13=b"",
        f14=b"",
        f20=b"",
        f24=b"",
    )
    rig.send(reg)
    assert not rig.peers and rig.rejects == ["unsupported"]
