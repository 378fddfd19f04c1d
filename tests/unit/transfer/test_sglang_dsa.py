"""An SGLang decode of a DSA model (``sglang.dsa``): its registration becomes a peer whose KV
list is its MLA pool and whose state pool is its FP8 index buffers; each request's index
pages must be its KV pages; anything else it registers or asks is refused with a reason that
names it, counted, and its rooms fail while other decodes go on."""

from __future__ import annotations

import struct

import pytest
import torch

from prefill_worker.kv.layout import MLA, KVLayout
from prefill_worker.model.index_fp8 import INDEX_FP8, IndexPages
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.sglang.dsa import accept_index_pool, index_want
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest, parse
from prefill_worker.transfer.validate import BootstrapLimits, Refusal, RejectReason
from tests.unit.transfer.test_sglang_desk import Rig
from tests.unit.transfer.test_sglang_frames_pins import changed, packed_lists

# The worker: 2 MLA layers, pages of 4 tokens of a 32-wide fp32 latent (512 B, the captured
# registration's page); an index page is 4 x (128 + 4) = 528 B. The captured decode has 17.
LAYOUT = KVLayout(2, 1, 32, "float32", 4, 64, MLA)
IX_PTRS = [0x10000, 0x20000]
CPU = torch.device("cpu")


def ours(layers: tuple[int, ...] = (0, 1)):  # type: ignore[no-untyped-def]
    return IndexPages(layers, 64, 4, CPU).regions("cpu")


def dsa_registration(**frames_at: bytes) -> Registration:
    """SGLang 0.5.23's registration from a DSA decode: its MLA pool (2 latents) and its
    index buffers, one per layer, of 17 pages."""
    state = {
        "f6": struct.pack("<2Q", 0x1000, 0x2000),
        "f18": b"DRAM,DRAM",
        "f19": struct.pack("<2Q", 512, 512),
        "f8": packed_lists(IX_PTRS, fmt="Q"),
        "f13": packed_lists([528, 528], fmt="I"),
        "f14": packed_lists([], fmt="I"),
        "f20": packed_lists([], fmt="I"),
        "f24": packed_lists([528 * 17] * 2, fmt="Q"),
    }
    reg = parse(changed("registration", **{**state, **frames_at}))
    assert isinstance(reg, Registration)
    return reg


def test_a_dsa_registration_is_its_mla_pool_and_an_index_pool() -> None:
    pool = accept_index_pool(dsa_registration(), LAYOUT, ours(), BootstrapLimits())
    assert not isinstance(pool, Refusal)
    assert not pool.registration.has_state and pool.registration.kv_ptrs == (0x1000, 0x2000)
    component = pool.index.component
    assert (component.kind, component.layer_ids, component.num_items) == (INDEX_FP8, (0, 1), 17)
    assert pool.index.base_addrs == (tuple(IX_PTRS),) and pool.index.device == "cpu"


def test_each_rank_of_an_attention_tp_2_decode_holds_the_whole_index_pool() -> None:
    """Neither the latent nor the index keys split by attention TP: rank 1 of 2 registers
    (and is accepted with) the same index pool as a decode of TP 1."""
    reg = dsa_registration(f10=b"2", f11=b"1")
    assert (reg.tp_size, reg.tp_rank) == (2, 1)
    pool = accept_index_pool(reg, LAYOUT, ours(), BootstrapLimits())
    assert not isinstance(pool, Refusal), pool
    assert pool.index.base_addrs == (tuple(IX_PTRS),) and pool.index.component.num_items == 17


def test_a_layer_without_an_indexer_has_a_buffer_of_no_pages() -> None:
    """GLM-5's shared layers: SGLang keeps their place with a buffer of no items."""
    reg = dsa_registration(f13=packed_lists([528, 0], fmt="I"))
    pool = accept_index_pool(reg, LAYOUT, ours((0,)), BootstrapLimits())
    assert not isinstance(pool, Refusal) and pool.index.base_addrs == ((IX_PTRS[0],),)
    refused = accept_index_pool(dsa_registration(), LAYOUT, ours((0,)), BootstrapLimits())
    assert isinstance(refused, Refusal) and refused.reason is RejectReason.LAYOUT_MISMATCH


NO_STATE = {"f8": b"", "f13": b"", "f14": b"", "f20": b"", "f24": b""}


@pytest.mark.parametrize(
    ("frames_at", "reason", "words"),
    [
        (NO_STATE, RejectReason.UNSUPPORTED, "registered no DSA index pool"),
        (
            {
                "f8": packed_lists(IX_PTRS, [0x30000], fmt="Q"),
                "f13": packed_lists([528, 528], [64], fmt="I"),
                "f14": b"",
                "f20": b"",
                "f24": b"",
            },
            RejectReason.UNSUPPORTED,
            "registered 2 state components",
        ),
        ({"f14": packed_lists([4], fmt="I")}, RejectReason.UNSUPPORTED, "not a DSA index pool"),
        (
            {"f13": packed_lists([512, 512], fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "pages of [512] bytes; this worker's: 2 layers, pages of 528 bytes",
        ),
        (
            {
                "f8": packed_lists(IX_PTRS[:1], fmt="Q"),
                "f13": packed_lists([528], fmt="I"),
                "f24": packed_lists([528 * 17], fmt="Q"),
            },
            RejectReason.LAYOUT_MISMATCH,
            "index pool of 1 layers",
        ),
        ({"f24": b""}, RejectReason.UNSUPPORTED, "state_data_lens, sent from SGLang 0.5.23"),
        (
            {"f24": packed_lists([528 * 17, 528 * 18], fmt="Q")},
            RejectReason.UNSUPPORTED,
            "without one size for all",
        ),
        (
            {"f24": packed_lists([528 * 16] * 2, fmt="Q")},
            RejectReason.LAYOUT_MISMATCH,
            "index pool of 16 pages for a KV pool of 17: an index page per KV page",
        ),
        ({"f8": packed_lists([0, 1], fmt="Q")}, RejectReason.BAD_ADDRESS, "index region"),
    ],
)
def test_what_a_dsa_pool_must_be(
    frames_at: dict[str, bytes], reason: RejectReason, words: str
) -> None:
    refusal = accept_index_pool(dsa_registration(**frames_at), LAYOUT, ours(), BootstrapLimits())
    assert isinstance(refusal, Refusal)
    assert (refusal.reason, words in refusal.message) == (reason, True), refusal.message


def test_an_index_pool_past_the_page_bound_is_refused() -> None:
    reg = dsa_registration()
    fits = accept_index_pool(reg, LAYOUT, ours(), BootstrapLimits(max_peer_pages=17))
    assert not isinstance(fits, Refusal)
    refusal = accept_index_pool(reg, LAYOUT, ours(), BootstrapLimits(max_peer_pages=16))
    assert isinstance(refusal, Refusal) and refusal.reason is RejectReason.TOO_LARGE
    assert "index pool of 17 pages; this worker takes at most 16" in refusal.message


def request(*lists: list[int]) -> TransferRequest:
    req = parse(changed("request", f8=packed_lists(*lists), f9=b"0"))  # pages 3, 5, 7
    assert isinstance(req, TransferRequest)
    return req


def test_the_index_pages_must_be_the_kv_pages() -> None:
    want = index_want(request([3, 5, 7]))
    assert not isinstance(want, Refusal) and list(want.dst_page_ids) == [3, 5, 7]
    other = index_want(request([3, 7, 5]))
    assert isinstance(other, Refusal) and other.reason is RejectReason.BAD_WANT
    two = index_want(request([3, 5, 7], [1]))
    assert isinstance(two, Refusal) and "names 2 state index lists" in two.message


# -- through the desk -------------------------------------------------------------------


def test_the_desk_registers_a_dsa_decode_with_its_index_pool() -> None:
    rig = Rig(layout=LAYOUT, dsa=ours())
    rig.send(dsa_registration())
    [peer] = rig.peers.values()
    assert peer.regions.layout.num_layers == 2 and peer.route is None
    assert peer.state is not None and peer.state.regions.component.num_items == 17
    rig.send(request([3, 5, 7]))
    sender = rig.hub.create_sender(1234, "req", 12)
    assert sender.poll() is KVPoll.READY, sender.failure_reason()
    rig.send(request([3, 7, 5]))  # that room is refused, the decode goes on
    rig.hub.drain()
    assert rig.rejects == ["bad_want"] and list(rig.peers) == [peer.agent_name]


def test_a_decode_without_an_index_pool_is_refused_and_hears_why() -> None:
    rig = Rig(layout=LAYOUT, dsa=ours())
    rig.send(dsa_registration(**NO_STATE))
    assert not rig.peers and rig.rejects == ["unsupported"]
    sender = rig.hub.create_sender(1234, "req", 12)
    rig.send(request())
    reason = rig.replies.sent[-1][1][4].decode()
    assert reason.startswith("registration refused: the decode registered no DSA index pool")
    rig.hub.drain()
    assert sender.poll() is KVPoll.FAILED
