"""An SGLang decode of a hybrid linear-attention model (``sglang.mamba``): its registration
becomes a peer whose KV list is the full layers and whose state pool is its ``MambaPool`` in
the staging's layout; each request names one slot of it; anything else it registers or asks
is refused with a reason that names it. The stage (``sglang.mamba_stage``) holds our slot in
that layout, byte for byte: the recurrent matrix transposed, the conv cast."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from prefill_worker.kv.layout import KVRegions
from prefill_worker.kv.state_layout import LINEAR_STATE, StateRegions
from prefill_worker.request import TransferStats
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.nixl.state_lists import StateLists
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest, parse
from prefill_worker.transfer.sglang.mamba import accept_mamba, mamba_want
from prefill_worker.transfer.sglang.mamba_stage import MambaStage, StagingSender
from prefill_worker.transfer.slot_stage import StagedState
from prefill_worker.transfer.validate import BootstrapLimits, Refusal, RejectReason
from tests.unit.transfer.test_sglang_desk import Rig as DeskRig
from tests.unit.transfer.test_sglang_frames_pins import changed, packed_lists
from tests.unit.transfer.test_sglang_swa import LAYOUT as _SWA_LAYOUT
from tests.unit.transfer.test_sglang_swa import ListingAgent

# The worker: 5 layers, 1 and 4 full (its KV pool: pages of 4 tokens of 2 heads x 16 fp32,
# 512 B), 0, 2 and 3 linear (2 key heads of 12, 6 value heads of 10, conv kernel 4).
LAYOUT = dataclasses.replace(_SWA_LAYOUT, num_layers=2)
FULL, LINEAR = (1, 4), (0, 2, 3)
CONV_DIM, HV, DK, DV = 2 * 2 * 12 + 6 * 10, 6, 12, 10
CONV_BYTES, TEMPORAL_BYTES = CONV_DIM * 3 * 4, HV * DV * DK * 4  # 1296, 2880 (fp32)
PTRS = [0x10000 * (i + 1) for i in range(6)]  # conv of 0, 2, 3; then temporal
NUM_SLOTS = 9  # SGLang's pool: size + 1


def stage(conv_dtype: str = "float32", num_slots: int = 4) -> MambaStage:
    """Over a state pool of ``num_slots`` whose slot s holds values s + 1, ..."""
    gen = torch.Generator().manual_seed(0)
    conv = [torch.randn((num_slots, CONV_DIM, 3), generator=gen) for _ in LINEAR]
    recurrent = [torch.randn((num_slots, HV, DK, DV), generator=gen) for _ in LINEAR]
    return MambaStage(LINEAR, conv, recurrent, conv_dtype, "cpu", (24, 24, 60))


GROUPS = ((24, 2), (24, 2), (60, 6))  # q, k, v: channels and heads
SIDE = StagedState(FULL, stage(), GROUPS, HV)


def mamba_registration(**frames_at: bytes) -> Registration:
    """SGLang 0.5.23's registration from a decode of this model: its KV list the full layers
    (K of 1 and 4, then V), its mamba pool 6 buffers of 9 slots."""
    state = {
        "f6": struct.pack("<4Q", 0x1000, 0x2000, 0x3000, 0x4000),
        "f18": b"DRAM,DRAM,DRAM,DRAM",
        "f19": struct.pack("<4Q", *[512] * 4),
        "f21": struct.pack("<4I", *FULL, *FULL),
        "f8": packed_lists(PTRS, fmt="Q"),
        "f13": packed_lists([CONV_BYTES] * 3 + [TEMPORAL_BYTES] * 3, fmt="I"),
        "f14": packed_lists([CONV_DIM] * 3 + [HV] * 3, fmt="I"),
        "f20": packed_lists([*LINEAR, *LINEAR], fmt="I"),
        "f24": packed_lists([CONV_BYTES * 9] * 3 + [TEMPORAL_BYTES * 9] * 3, fmt="Q"),
    }
    reg = parse(changed("registration", **{**state, **frames_at}))
    assert isinstance(reg, Registration)
    return reg


def test_a_mamba_registration_is_its_full_layers_and_a_pool_of_slots() -> None:
    pool = accept_mamba(mamba_registration(), SIDE, BootstrapLimits())
    assert not isinstance(pool, Refusal), pool
    reg = pool.registration
    assert not reg.has_state and reg.state == () and reg.kv_layer_ids == ()
    assert reg.kv_ptrs == (0x1000, 0x2000, 0x3000, 0x4000)
    component = pool.state.component
    assert (component.kind, component.layer_ids, component.num_items) == (LINEAR_STATE, LINEAR, 9)
    conv, temporal = component.tensors
    assert (conv.item_shape, conv.item_bytes) == ((CONV_DIM, 3), CONV_BYTES)
    assert (temporal.item_shape, temporal.item_bytes) == ((HV, DV, DK), TEMPORAL_BYTES)
    assert pool.state.base_addrs == (tuple(PTRS[:3]), tuple(PTRS[3:]))
    assert pool.state.device == "cpu"


def fields(ptrs: list[int], items: list[int], dims: list[int], ids: list[int], lens: list[int]):  # type: ignore[no-untyped-def]
    return {
        "f8": packed_lists(ptrs, fmt="Q"),
        "f13": packed_lists(items, fmt="I"),
        "f14": packed_lists(dims, fmt="I"),
        "f20": packed_lists(ids, fmt="I"),
        "f24": packed_lists(lens, fmt="Q"),
    }


ITEMS = [CONV_BYTES] * 3 + [TEMPORAL_BYTES] * 3
LENS = [CONV_BYTES * 9] * 3 + [TEMPORAL_BYTES * 9] * 3
NO_STATE = {"f8": b"", "f13": b"", "f14": b"", "f20": b"", "f24": b""}


@pytest.mark.parametrize(
    ("frames_at", "reason", "words"),
    [
        (
            {"f10": b"4", "f11": b"0"},
            RejectReason.UNSUPPORTED,
            "attention TP 4 with a mamba pool: it does not split the linear layers' heads [2, 2, 6",
        ),
        ({"f10": b"2", "f11": b"2"}, RejectReason.UNSUPPORTED, "attention TP rank 2 of 2"),
        (
            {"f10": b"2", "f11": b"0"},
            RejectReason.LAYOUT_MISMATCH,
            "split dims [108, 108, 108, 6, 6, 6], this model's [54, 54, 54, 3, 3, 3]",
        ),
        (
            {"f10": b"2", "f11": b"0", "f14": b""},
            RejectReason.LAYOUT_MISMATCH,
            "stages [54, 3] float32 (648",
        ),
        (NO_STATE, RejectReason.UNSUPPORTED, "registered 0 state components"),
        (
            {
                "f8": packed_lists(PTRS, [1], fmt="Q"),
                "f13": packed_lists(ITEMS, [8], fmt="I"),
                "f14": b"",
                "f20": b"",
                "f24": b"",
            },
            RejectReason.UNSUPPORTED,
            "registered 2 state components",
        ),
        (
            {"f21": struct.pack("<4I", 0, 1, 0, 1)},
            RejectReason.LAYOUT_MISMATCH,
            "KV list is of layers [0, 1, 0, 1]; this model's full-attention layers are [1, 4]",
        ),
        (
            fields(PTRS[:4], ITEMS[:4], [], [0, 2, 0, 2], LENS[:4]),
            RejectReason.LAYOUT_MISMATCH,
            "registered 4 mamba buffers; this model has 3 linear layers (6",
        ),
        (
            fields(PTRS, ITEMS[:5], [], [*LINEAR, *LINEAR], LENS),
            RejectReason.LAYOUT_MISMATCH,
            "registered 6 mamba buffers",
        ),
        (
            {"f20": packed_lists([0, 0, 2, 2, 3, 3], fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "state buffers are of layers [0, 0, 2, 2, 3, 3]; this model's linear layers are",
        ),
        (
            {"f14": packed_lists([HV] * 3 + [CONV_DIM] * 3, fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "split dims [6, 6, 6, 108, 108, 108], this model's [108, 108, 108, 6, 6, 6]",
        ),
        (
            {"f13": packed_lists([CONV_BYTES // 2] * 3 + [TEMPORAL_BYTES] * 3, fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "conv state slot is [648] bytes; this worker stages [108, 3] float32 (1296 bytes)",
        ),
        (
            {"f13": packed_lists([CONV_BYTES] * 3 + [TEMPORAL_BYTES // 2] * 3, fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "recurrent state slot is [1440] bytes; this worker stages [6, 10, 12] float32",
        ),
        (
            {"f13": packed_lists([CONV_BYTES] * 2 + [8] + [TEMPORAL_BYTES] * 3, fmt="I")},
            RejectReason.LAYOUT_MISMATCH,
            "conv state slot is [8, 1296] bytes",
        ),
        ({"f24": b""}, RejectReason.UNSUPPORTED, "state_data_lens, sent from SGLang 0.5.23"),
        (
            {"f24": packed_lists(LENS[:5], fmt="Q")},
            RejectReason.UNSUPPORTED,
            "without one slot count for all",
        ),
        (
            {"f24": packed_lists([CONV_BYTES * 9] * 3 + [TEMPORAL_BYTES * 8] * 3, fmt="Q")},
            RejectReason.UNSUPPORTED,
            "without one slot count for all",
        ),
        (
            {"f24": packed_lists([CONV_BYTES * 9 + 4] * 3 + [TEMPORAL_BYTES * 9] * 3, fmt="Q")},
            RejectReason.UNSUPPORTED,
            "without one slot count for all",
        ),
        (
            {"f24": packed_lists([CONV_BYTES - 4] * 3 + [TEMPORAL_BYTES - 4] * 3, fmt="Q")},
            RejectReason.UNSUPPORTED,
            "without one slot count",
        ),
        (
            {"f24": packed_lists([0] * 6, fmt="Q")},
            RejectReason.TOO_LARGE,
            "mamba pool of 0 slots",
        ),
        (
            {"f8": packed_lists([0, 1, 2, 3, 4, 5], fmt="Q")},
            RejectReason.BAD_ADDRESS,
            "mamba state region",
        ),
    ],
)
def test_what_a_mamba_pool_must_be(
    frames_at: dict[str, bytes], reason: RejectReason, words: str
) -> None:
    refusal = accept_mamba(mamba_registration(**frames_at), SIDE, BootstrapLimits())
    assert isinstance(refusal, Refusal), refusal
    assert refusal.reason is reason and words in refusal.message, refusal.message


def test_the_temporal_refusal_names_the_ssm_dtype_and_the_conv_one_the_conv_dtype() -> None:
    conv = {"f13": packed_lists([CONV_BYTES // 2] * 3 + [TEMPORAL_BYTES] * 3, fmt="I")}
    refusal = accept_mamba(mamba_registration(**conv), SIDE, BootstrapLimits())
    assert isinstance(refusal, Refusal) and "SGLANG_MAMBA_CONV_DTYPE" in refusal.message
    assert "transfer.sglang_mamba_conv_dtype" in refusal.message
    ssm = {"f13": packed_lists([CONV_BYTES] * 3 + [TEMPORAL_BYTES // 2] * 3, fmt="I")}
    refusal = accept_mamba(mamba_registration(**ssm), SIDE, BootstrapLimits())
    assert isinstance(refusal, Refusal) and "SGLANG_MAMBA_SSM_DTYPE" in refusal.message


def test_a_decode_without_split_dims_is_taken_and_a_pool_past_the_bound_is_not() -> None:
    reg = mamba_registration(f14=packed_lists([], fmt="I"))
    assert not isinstance(accept_mamba(reg, SIDE, BootstrapLimits()), Refusal)
    limits = dataclasses.replace(BootstrapLimits(), max_peer_pages=8)
    refusal = accept_mamba(mamba_registration(), SIDE, limits)
    assert isinstance(refusal, Refusal) and refusal.reason is RejectReason.TOO_LARGE
    assert "mamba pool of 9 slots; this worker takes 1 to 8" in refusal.message
    at_bound = dataclasses.replace(limits, max_peer_pages=9)
    assert not isinstance(accept_mamba(mamba_registration(), SIDE, at_bound), Refusal)


def test_a_vram_pool_is_on_the_decodes_gpu() -> None:
    reg = mamba_registration(f18=b"VRAM,VRAM,VRAM,VRAM", f9=b"3")
    pool = accept_mamba(reg, SIDE, BootstrapLimits())
    assert not isinstance(pool, Refusal) and pool.state.device == "cuda:3"


def request(*lists: list[int], prefix: int = 0) -> TransferRequest:
    req = parse(changed("request", f8=packed_lists(*lists), f9=b"%d" % prefix))
    assert isinstance(req, TransferRequest)
    return req


def test_the_mamba_slot_rides_with_the_want() -> None:
    want = mamba_want(request([7]))
    assert not isinstance(want, Refusal)
    assert want.dst_state_slot == 7 and list(want.dst_page_ids) == [3, 5, 7]
    for lists in (([7], [8]), ([7, 8],), ([],)):
        refusal = mamba_want(request(*lists))
        assert isinstance(refusal, Refusal) and refusal.reason is RejectReason.UNSUPPORTED
        assert "a decode with a mamba pool names one list of one slot" in refusal.message


# -- through the desk -------------------------------------------------------------------


OURS = KVRegions(LAYOUT, (0x100000, 0x200000), (0x300000, 0x400000), "cpu", 0x500000, 8)


def desk_rig(agent: ListingAgent | None = None, mamba: StagedState | None = SIDE) -> DeskRig:
    ours = StateLists(SIDE.stage.regions(), "ours")
    return DeskRig(layout=LAYOUT, agent=agent, mamba=mamba, state=ours, regions=OURS)


def test_the_desk_registers_a_mamba_decode_with_its_pool_prepared() -> None:
    agent = ListingAgent()
    rig = desk_rig(agent)
    reg = mamba_registration()
    rig.send(reg)
    [peer] = rig.peers.values()
    assert peer.regions.layout.num_layers == 2 and peer.route is None
    assert peer.regions.k_base_addrs == (0x1000, 0x2000)
    _, _, pool = agent.lists
    assert peer.state is not None and peer.state.prepped is pool and pool.name == reg.agent_name
    rows = [[a, CONV_BYTES, 0, CONV_BYTES, 9] for a in PTRS[:3]]
    rows += [[a, TEMPORAL_BYTES, 0, TEMPORAL_BYTES, 9] for a in PTRS[3:]]
    assert pool.table.tolist() == rows
    rig.send(request([8]))  # 12 tokens: 3 pages, slot 8 of 9
    sender = rig.hub.create_sender(1234, "req", 12)
    assert sender.poll() is KVPoll.READY, sender.failure_reason()
    assert not rig.rejects


def test_a_slot_outside_the_decodes_pool_fails_the_room() -> None:
    rig = desk_rig()
    rig.send(mamba_registration())
    rig.send(request([9]))
    sender = rig.hub.create_sender(1234, "req", 12)
    assert sender.poll() is KVPoll.FAILED
    assert "dst_state_slot 9 outside 0..8" in str(sender.failure_reason())


def test_a_request_without_one_slot_is_refused() -> None:
    rig = desk_rig()
    rig.send(mamba_registration())
    rig.send(request([8], [4]))
    rig.hub.drain()
    assert rig.rejects == ["unsupported"]
    assert b"names one list of one slot" in rig.replies.sent[-1][1][4]


def test_a_decode_without_a_mamba_pool_hears_why_on_its_request() -> None:
    rig = desk_rig()
    rig.send(mamba_registration(**NO_STATE, f21=b""))
    assert not rig.peers and rig.rejects == ["unsupported"]
    rig.send(request([]))
    reason = rig.replies.sent[-1][1][4].decode()
    assert reason.startswith("registration refused: the decode registered 0 state components")


def test_a_model_without_linear_layers_refuses_the_mamba_decode() -> None:
    rig = DeskRig(layout=LAYOUT)
    rig.send(mamba_registration())
    assert not rig.peers and rig.rejects == ["unsupported"]


# -- the stage --------------------------------------------------------------------------


def test_the_stage_holds_our_slot_transposed_and_cast() -> None:
    ours = stage("bfloat16")
    ours.fill(2)
    for layer in range(len(LINEAR)):
        assert torch.equal(ours.conv[layer][2], ours._conv[layer][2].to(torch.bfloat16))
        assert torch.equal(ours.temporal[layer][2], ours._recurrent[layer][2].transpose(-1, -2))
        for other in (0, 1, 3):  # another request's staging slot is left alone
            assert not ours.conv[layer][other].any() and not ours.temporal[layer][other].any()


def test_the_staging_regions_are_the_decodes_layout_at_the_staged_tensors() -> None:
    ours = stage("bfloat16")
    regions = ours.regions()
    assert isinstance(regions, StateRegions) and regions.device == "cpu"
    component = regions.component
    assert (component.kind, component.layer_ids, component.num_items) == (LINEAR_STATE, LINEAR, 4)
    conv, temporal = component.tensors
    assert (conv.name, conv.item_shape, conv.dtype, conv.item_bytes) == (
        "conv",
        (CONV_DIM, 3),
        "bfloat16",
        CONV_BYTES // 2,
    )
    assert (temporal.item_shape, temporal.dtype) == ((HV, DV, DK), "float32")
    assert temporal.item_bytes == TEMPORAL_BYTES
    assert regions.base_addrs == (
        tuple(t.data_ptr() for t in ours.conv),
        tuple(t.data_ptr() for t in ours.temporal),
    )
    assert ours.num_bytes == 4 * 3 * (CONV_BYTES // 2 + TEMPORAL_BYTES)


class Inner:
    """A sender that records what was asked of it."""

    def __init__(self, poll: KVPoll = KVPoll.READY, num_ranks: int = 1) -> None:
        self.state, self.calls = poll, []  # type: ignore[var-annotated]
        self.num_ranks = num_ranks  # its decode's ranks

    def poll(self) -> KVPoll:
        return self.state

    def num_cached_tokens(self) -> int:
        return 8

    def send_pages(self, page_ids, first_page, sliding_page_ids=()) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("pages", list(page_ids), first_page))

    def send_aux(self, aux_row: int) -> None:
        self.calls.append(("aux", aux_row))

    def fail(self, reason: str) -> None:
        self.calls.append(("fail", reason))

    def failure_reason(self) -> str | None:
        return "why"

    def why_no_handshake(self) -> str | None:
        return "nobody"

    def transfer_stats(self) -> TransferStats:
        return TransferStats(bytes=5)

    def close(self) -> None:
        self.calls.append(("close",))

    def bound(self):  # type: ignore[no-untyped-def]
        return [("peer", "want")]

    def also_wait_for(self, writes) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("wait for", writes))


class Recording:
    def __init__(self) -> None:
        self.filled: list[tuple[int, int]] = []

    def regions(self) -> StateRegions:
        raise AssertionError("not asked")

    def fill(self, slot: int, num_shares: int = 1) -> None:
        self.filled.append((slot, num_shares))


def test_the_slot_is_staged_when_the_aux_row_is_handed_over() -> None:
    inner, staged = Inner(num_ranks=2), Recording()
    sender = StagingSender(inner, staged)
    sender.send_pages([4, 5], 1)
    assert staged.filled == []
    sender.send_aux(3)  # staged for its decode's 2 ranks
    assert staged.filled == [(3, 2)] and inner.calls == [("pages", [4, 5], 1), ("aux", 3)]
    assert sender.poll() is KVPoll.READY and sender.num_cached_tokens() == 8
    assert (sender.failure_reason(), sender.why_no_handshake()) == ("why", "nobody")
    assert sender.transfer_stats().bytes == 5
    sender.fail("no")
    sender.close()
    assert inner.calls[-2:] == [("fail", "no"), ("close",)]


def test_a_sender_that_already_ended_stages_nothing() -> None:
    inner, staged = Inner(KVPoll.FAILED), Recording()
    StagingSender(inner, staged).send_aux(3)
    assert staged.filled == [] and inner.calls == [("aux", 3)]


# -- a decode of attention TP 2 ------------------------------------------------------------


def rank_registration(rank: int, **frames_at: bytes) -> Registration:
    """Rank ``rank`` of a decode of attention TP 2: one KV head (pages of 256 B), half of
    each mamba item (conv [54, 3], temporal [3, 10, 12])."""
    half = {
        "f10": b"2",
        "f11": b"%d" % rank,
        "f12": b"256",
        "f19": struct.pack("<4Q", *[256] * 4),
        "f13": packed_lists([CONV_BYTES // 2] * 3 + [TEMPORAL_BYTES // 2] * 3, fmt="I"),
        "f14": packed_lists([CONV_DIM // 2] * 3 + [HV // 2] * 3, fmt="I"),
        "f24": packed_lists([CONV_BYTES // 2 * 9] * 3 + [TEMPORAL_BYTES // 2 * 9] * 3, fmt="Q"),
    }
    return mamba_registration(**{**half, **frames_at})


def test_a_rank_of_attention_tp_2_holds_half_of_each_item() -> None:
    pool = accept_mamba(rank_registration(1), SIDE, BootstrapLimits())
    assert not isinstance(pool, Refusal), pool
    conv, temporal = pool.state.component.tensors
    assert (conv.item_shape, conv.item_bytes) == ((CONV_DIM // 2, 3), CONV_BYTES // 2)
    assert (temporal.item_shape, temporal.item_bytes) == ((HV // 2, DV, DK), TEMPORAL_BYTES // 2)
    assert pool.state.component.num_items == 9


def test_the_stage_puts_each_ranks_channels_together() -> None:
    """Two ranks: rank 0's q, k, v channels (0..11, 24..35, 48..77), then rank 1's."""
    ours = stage()
    ours.fill(1, 2)
    order = [*range(0, 12), *range(24, 36), *range(48, 78)]
    order += [*range(12, 24), *range(36, 48), *range(78, 108)]
    for layer in range(len(LINEAR)):
        assert torch.equal(ours.conv[layer][1], ours._conv[layer][1][order])
        assert torch.equal(ours.temporal[layer][1], ours._recurrent[layer][1].transpose(-1, -2))
    ours.fill(1)  # one rank: our order
    assert torch.equal(ours.conv[0][1], ours._conv[0][1])
    ours.fill(3, 2)  # the order again (kept)
    assert torch.equal(ours.conv[2][3], ours._conv[2][3][order])


class ShareAgent(ListingAgent):
    """Also lists our own memory (``NIXL_INIT_AGENT``); refuses those when ``fail_local``."""

    def __init__(self, fail_local: bool = False) -> None:
        super().__init__()
        self.fail_local = fail_local

    def prep_xfer_dlist(self, name, table, mem_type):  # type: ignore[no-untyped-def]
        if name == "NIXL_INIT_AGENT" and self.fail_local:
            raise NIXL_ERRORS[0]("no such memory")
        return super().prep_xfer_dlist(name, table, mem_type)


def test_each_rank_is_written_its_share_of_our_staged_slot() -> None:
    agent = ShareAgent()
    rig = desk_rig(agent)
    staged = SIDE.stage.regions()
    rig.send(rank_registration(0))
    rig.send(rank_registration(1, **renamed("decode-rank-1"), f3=b"17001"))
    assert len(rig.peers) == 2, rig.rejects
    shares = [p.local_state for p in sorted(rig.peers.values(), key=lambda p: p.tp_rank)]
    local = [
        listed
        for listed in agent.lists
        if listed.name == "NIXL_INIT_AGENT" and listed.table.shape == (6, 5)
    ]
    assert len(local) == 2 and [s.prepped for s in shares if s is not None] == local
    for rank, listed in enumerate(local):  # per run: its half of each of our 4 slots
        sizes = [CONV_BYTES // 2] * 3 + [TEMPORAL_BYTES // 2] * 3
        rows = [
            [addr + rank * size, size, 0, 2 * size, 4]
            for (addr, _), size in zip(staged.runs, sizes, strict=True)
        ]
        assert listed.table.tolist() == rows
    share = shares[1]
    assert share is not None and share.regions.component.num_items == 4
    assert share.regions.component.slot_bytes == (CONV_BYTES + TEMPORAL_BYTES) // 2 * 3
    rig.desk.release_shares()
    assert all(listed.is_released for listed in local)


def renamed(name: str) -> dict[str, bytes]:
    """Frames 4 and 5 of the captured registration for an agent of another name."""
    metadata, head = changed("registration")[5], b"nixlSerDes|Agent"
    rest = metadata[24 + int.from_bytes(metadata[16:24], "little") :]
    return {
        "f4": name.encode(),
        "f5": head + len(name).to_bytes(8, "little") + name.encode() + rest,
    }


def test_a_share_nixl_cannot_list_refuses_the_decode() -> None:
    rig = desk_rig(ShareAgent(fail_local=True))
    rig.send(rank_registration(0))
    assert not rig.peers and rig.rejects == ["nixl_refused"]
    rig.send(request([8]))  # the decode hears why, by its name
    reason = rig.replies.sent[-1][1][4].decode()
    assert (
        reason
        == "registration refused: NIXL cannot list our staged state for the decode: no such memory"
    )


def test_a_tp_1_decode_takes_whole_slots() -> None:
    rig = desk_rig()
    rig.send(mamba_registration())
    [peer] = rig.peers.values()
    assert peer.local_state is None


def test_a_tp_groups_mirror_sees_the_decode_ranks_it_is_bound_to() -> None:
    """At TP > 1 the group's mirror binds the followers' writes to the decode ranks the
    leader's sender is bound to (``transfer.group.Bound``); a staging sender that hid them
    let the followers write no KV head while the room still succeeded."""
    from prefill_worker.transfer.group import Bound

    inner = Inner()
    sender = StagingSender(inner, Recording())
    assert isinstance(sender, Bound) and sender.bound() == [("peer", "want")]
    sender.also_wait_for("writes")  # type: ignore[arg-type]
    assert inner.calls == [("wait for", "writes")]
