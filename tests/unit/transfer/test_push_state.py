"""A hybrid model's state on the native push: the request's state slot (its aux row) goes whole
into the slot the decode's ``want`` named, after every page landed and before the aux row (whose
notification completes the room); a decode without a state pool, or a want without a slot, is
refused ``state_unsupported`` before a byte is written; a dropped peer's state list is
released. Against the scripted agent of ``test_push_sender``."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
from msgspec import UNSET

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.state_layout import (
    LINEAR_STATE,
    StateComponent,
    StateRegions,
    StateTensor,
    mismatch,
)
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.state_lists import StateLists, state_table
from prefill_worker.transfer.pagemap import check_want_state
from tests.unit.transfer.test_push_sender import PAGE_RUN_BYTES, REGIONS, Rig

CONV = StateTensor("conv", (6, 3), "float32", 72)
RECURRENT = StateTensor("recurrent", (2, 3, 4), "float32", 96)
COMPONENT = StateComponent(LINEAR_STATE, (0, 2, 3), (CONV, RECURRENT), 4)  # 4 worker slots
WORKER = StateRegions(COMPONENT, ((1000, 2000, 3000), (4000, 5000, 6000)), "cpu")
DECODE = StateRegions(
    dataclasses.replace(COMPONENT, num_items=9), ((10, 20, 30), (40, 50, 60)), "cpu"
)


class Released:
    def __init__(self) -> None:
        self.is_released = False

    def release(self) -> None:
        self.is_released = True


@pytest.fixture
def rig() -> Rig:
    rig = Rig("native")
    rig.ctx = dataclasses.replace(rig.ctx, state=StateLists(WORKER, "state"))
    rig.hub.ctx = rig.ctx
    rig.peer.state = StateLists(DECODE, Released())
    return rig


def bind(rig: Rig, dst_state_slot: int | object = 7, room: int = 7):  # type: ignore[no-untyped-def]
    sender = rig.hub.create_sender(room, f"req-{room}", 16)
    slot = UNSET if dst_state_slot is UNSET else dst_state_slot
    rig.hub.want(rig.peer, wire.Want.of(room, [3, 4, 5, 6], 2, 0, slot))  # type: ignore[arg-type]
    return sender


def test_the_state_slot_goes_after_the_pages_and_before_the_aux_row(rig: Rig) -> None:
    sender = bind(rig)
    assert sender.poll() is KVPoll.READY
    sender.send_pages([0, 1, 2, 3], 0)
    sender.send_aux(1)
    sender.progress()
    assert len(rig.agent.handles) == 1  # pages in flight: nothing else yet
    rig.land(0)
    sender.progress()
    [_, state] = rig.agent.handles
    _, local, local_idx, remote, remote_idx, notif = state.args
    assert (local, notif) == ("state", b"")
    assert remote is rig.peer.state.prepped  # type: ignore[union-attr]
    # runs (tensor, layer) in order; slot 1 of the worker's 4, slot 7 of the decode's 9
    assert list(local_idx) == [1, 5, 9, 13, 17, 21]
    assert list(remote_idx) == [7, 16, 25, 34, 43, 52]
    sender.progress()
    assert len(rig.agent.handles) == 2  # the aux row waits for the state
    rig.land(1)
    sender.progress()
    aux = rig.agent.handles[2]
    assert aux.args[1] == "aux" and aux.args[5] == wire.notif_tag(7)
    rig.land(2)
    sender.progress()
    rig.hub.drain()
    assert rig.heard.said == [(7, "ok", None, None)] and sender.poll() is KVPoll.SUCCESS
    landed = 4 * PAGE_RUN_BYTES + COMPONENT.slot_bytes + AUX_ROW_BYTES
    assert sender.transfer_stats().bytes == landed


@pytest.mark.parametrize(
    ("has_pool", "slot", "why"),
    [
        (False, 7, "state_unsupported: the decode registered no linear_state state"),
        (True, UNSET, "state_unsupported: the want names no dst_state_slot"),
        (True, 9, "dst_state_slot 9 outside 0..8"),
        (True, -1, "dst_state_slot -1 outside 0..8"),
    ],
)
def test_a_want_that_cannot_take_the_state_fails_the_room(
    rig: Rig, has_pool: bool, slot: object, why: str
) -> None:
    if not has_pool:
        rig.peer.state = None
    sender = bind(rig, slot)
    assert sender.poll() is KVPoll.FAILED
    assert str(sender.failure_reason()).startswith(why)
    assert not rig.agent.handles  # not a byte


def test_the_last_slots_are_taken() -> None:
    want = wire.Want.of(1, [], 0, 0, 8)
    assert check_want_state(want, COMPONENT, DECODE) is None
    assert check_want_state(wire.Want.of(1, [], 0, 0, 0), COMPONENT, DECODE) is None
    assert check_want_state(wire.Want.of(1, [], 0, 0), None, None) is None  # no state: nothing


def test_a_dropped_peer_releases_its_state_list(rig: Rig) -> None:
    state = rig.peer.state
    rig.hub.drop_peer(rig.peer, "gone")
    assert state is not None and state.prepped.is_released
    assert rig.agent.forgotten == ["decode-1"]


def test_a_model_without_state_posts_none() -> None:
    rig = Rig("native")
    sender = rig.bound_sender()
    sender.send_aux(1)
    sender.progress()
    [aux] = rig.agent.handles
    assert aux.args[1] == "aux"


def test_regions_list_one_strided_run_per_tensor_and_layer() -> None:
    assert WORKER.runs == ((1000, 72), (2000, 72), (3000, 72), (4000, 96), (5000, 96), (6000, 96))
    table = state_table(WORKER)
    assert table.tolist() == [[a, n, 0, n, 4] for a, n in WORKER.runs]
    assert table.dtype == np.uint64
    with pytest.raises(ValueError, match=r"one address per layer \(3\).*got \[3, 2\]"):
        StateRegions(COMPONENT, ((1, 2, 3), (4, 5)), "cpu")


def test_mismatch_names_what_differs() -> None:
    assert mismatch(COMPONENT, dataclasses.replace(COMPONENT, num_items=1)) is None
    other = dataclasses.replace(COMPONENT, kind="swa")
    assert "state component 'swa' (slot, last_chunk) is not 'linear_state'" in str(
        mismatch(COMPONENT, other)
    )
    copied = dataclasses.replace(COMPONENT, copy="pages")
    assert "(pages, last_chunk)" in str(mismatch(COMPONENT, copied))
    timed = dataclasses.replace(COMPONENT, when="each_chunk")
    assert "(slot, each_chunk)" in str(mismatch(COMPONENT, timed))
    layers = dataclasses.replace(COMPONENT, layer_ids=(0, 2))
    assert mismatch(COMPONENT, layers) == "linear_state: layers [0, 2], this worker's are [0, 2, 3]"
    bf16 = dataclasses.replace(CONV, dtype="bfloat16", item_bytes=36)
    tensors = dataclasses.replace(COMPONENT, tensors=(bf16, RECURRENT))
    assert mismatch(COMPONENT, tensors) == (
        "linear_state: tensors conv [6, 3] bfloat16, recurrent [2, 3, 4] float32, this "
        "worker's are conv [6, 3] float32, recurrent [2, 3, 4] float32"
    )


def test_state_pools_round_trip_on_the_wire() -> None:
    pool = wire.StatePool.of(DECODE.component, DECODE.base_addrs)
    assert pool.regions("cpu") == DECODE
    msg = wire.Register.of("d", b"m", REGIONS, "h", state=(pool,))
    assert wire.decode(wire.encode(msg)) == msg
    body = msgspec.msgpack.decode(wire.encode(msg))
    body["state"][0]["base_addrs"] = [[1, 2, 3]]  # the recurrent tensor's addresses missing
    with pytest.raises(wire.WireError, match=r"got \[3\] - at `\$.state`"):
        wire.decode(msgspec.msgpack.encode(body))
    assert wire.decode(wire.encode(wire.Want.of(3, [1], 0, 0, 5))) == wire.Want.of(3, [1], 0, 0, 5)
    plain = wire.encode(wire.Want.of(3, [1], 0, 0))
    assert b"dst_state_slot" not in plain  # a v1 want's bytes are unchanged
    assert wire.decode(plain).dst_state_slot is UNSET  # type: ignore[union-attr]
    described = msgspec.msgpack.decode(
        wire.encode(
            wire.Registered(
                is_ok=True, agent_name="w", peer_timeout_s=1.0, heartbeat_interval_s=1.0
            )
        )
    )
    assert "state" not in described


def test_a_rank_holding_a_share_of_the_slot_is_written_its_share(rig: Rig) -> None:
    """A decode rank of attention TP 2 (SGLang's mamba pool): its share of our slot, from the
    list of that share (``Peer.local_state``), into its whole slot, with the share's bytes."""
    half = StateComponent(
        LINEAR_STATE,
        (0, 2, 3),
        (
            StateTensor("conv", (3, 3), "float32", 36),
            StateTensor("recurrent", (1, 3, 4), "float32", 48),
        ),
        4,
    )
    share = StateRegions(half, ((1036, 2036, 3036), (4048, 5048, 6048)), "cpu")
    rig.peer.local_state = StateLists(share, "share-1")
    sender = bind(rig)
    sender.send_pages([0, 1, 2, 3], 0)
    sender.send_aux(1)
    rig.land(0)
    sender.progress()
    [_, state] = rig.agent.handles
    _, local, local_idx, remote, remote_idx, _ = state.args
    assert local == "share-1" and remote is rig.peer.state.prepped  # type: ignore[union-attr]
    assert list(local_idx) == [1, 5, 9, 13, 17, 21] and list(remote_idx) == [7, 16, 25, 34, 43, 52]
    rig.land(1)
    sender.progress()
    rig.land(2)
    sender.progress()
    landed = 4 * PAGE_RUN_BYTES + half.slot_bytes + AUX_ROW_BYTES
    assert sender.transfer_stats().bytes == landed
