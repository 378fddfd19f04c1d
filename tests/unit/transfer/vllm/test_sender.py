"""The vLLM sender and desk on a fake clock: a room is a vLLM pull only with a ticket; the
answer's params name the staged blocks; every staging block returns to the pool on every
path (read, expiry, close before staging, a front that gave up, staging full, shutdown)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.vllm.desk import PullDesk, PullIdentity
from prefill_worker.transfer.vllm.holds import HoldTable
from prefill_worker.transfer.vllm.sender import VllmSender
from prefill_worker.transfer.vllm.shared import GroupStaging, Stage, StageQueue
from prefill_worker.transfer.vllm.staging import PoolViews, StagingPool, staging_layout
from prefill_worker.transfer.vllm.tickets import Tickets
from tests.clocks import FakeClock
from tests.polling import wait_until

BLOCKS = 6
REPACKER = ThreadPoolExecutor(1, thread_name_prefix="test-vllm-repack")  # as the backend's


def _desk(
    clock: FakeClock, repacker: Any = REPACKER, group: GroupStaging | None = None
) -> tuple[PullDesk, torch.Tensor]:
    lay = KVLayout(2, 1, 4, "float32", 16, 8)
    pool = torch.randn(2, 2, 8, 16, 1, 4)
    k = tuple(pool[i, 0].data_ptr() for i in range(2))
    v = tuple(pool[i, 1].data_ptr() for i in range(2))
    regions = KVRegions(lay, k, v, "cpu", 0, 0)
    heads = None if group is None else group.num_kv_heads
    layout = staging_layout(regions, block_size=32, num_blocks=BLOCKS, num_kv_heads=heads)
    staging = StagingPool(layout, None if group is None else group.buffer)
    holds, tickets = HoldTable(30.0, 5.0), Tickets(8)
    desk = PullDesk(staging, PoolViews(regions), holds, tickets, clock, repacker, group)
    desk.identities = {
        "0.33.0": PullIdentity("engine-1", "10.0.0.1", 5600, 7),
        "0.34.0": PullIdentity("engine-1", "10.0.0.1", 5601, 7),
    }
    return desk, pool


def _staged(desk: PullDesk, room: int, num_tokens: int, version: str | None = None) -> VllmSender:
    assert desk.tickets.open(room, version)
    sender = VllmSender(desk, room, num_tokens)
    assert sender.poll() is KVPoll.READY
    num_pages = -(-num_tokens // 16)
    sender.send_pages(list(range(num_pages)), 0)
    assert sender.poll() is KVPoll.TRANSFERRING
    sender.send_aux(0)
    wait_until(lambda: sender.poll().is_terminal, what="the repacks end")
    assert sender.poll() is KVPoll.SUCCESS
    sender.close()
    return sender


def test_without_a_ticket_the_room_is_not_a_vllm_pull() -> None:
    desk, _ = _desk(FakeClock(100.0))
    sender = VllmSender(desk, 1, 10)
    assert sender.poll() is KVPoll.BOOTSTRAPPING
    sender.fail("the room was taken by a decode on the sglang protocol")
    sender.close()
    assert sender.poll() is KVPoll.FAILED and desk.staging.num_free == BLOCKS


def test_params_name_the_staged_blocks_and_reads_free_them() -> None:
    desk, pool = _desk(FakeClock(100.0))
    sender = _staged(desk, 5, 33)
    params = desk.tickets.take(5)
    assert params is not None
    assert params["remote_block_ids"] == [[0, 1]] and params["remote_num_tokens"] == 33
    assert params["remote_engine_id"] == "engine-1" and params["remote_port"] == 5600
    assert params["remote_registration_generation"] == 7
    assert params["transfer_mode"] == "pull" and params["do_remote_prefill"] is True
    assert sender.transfer_stats().bytes == 33 * 2 * 2 * 4 * 4
    block0 = torch.from_numpy(desk.staging.layer_view(1)[0].view("float32"))  # [H, 32, 2D]
    assert torch.equal(block0[0, :16, 4:], pool[1, 1, 0, :, 0])  # V of layer 1, page 0
    assert desk.staging.num_free == BLOCKS - 2
    hold_id = params["remote_request_id"]
    desk.notify("d0", f"{hold_id}:1".encode())
    assert desk.staging.num_free == BLOCKS


def test_the_params_name_the_side_channel_of_the_version_asked() -> None:
    """Each vLLM version is served on its own side channel: a ticket opened for 0.34 answers
    with 0.34's port, one that names none with the first version's."""
    desk, _ = _desk(FakeClock(100.0))
    _staged(desk, 5, 10, "0.34.0")
    _staged(desk, 6, 10)
    asked, default = desk.tickets.take(5), desk.tickets.take(6)
    assert asked is not None and default is not None
    assert (asked["remote_port"], default["remote_port"]) == (5601, 5600)
    assert asked["remote_engine_id"] == default["remote_engine_id"] == "engine-1"
    assert asked["remote_request_id"] != default["remote_request_id"]


def test_a_decode_that_never_reads_frees_at_the_lease_plus_grace() -> None:
    clock = FakeClock(100.0)
    desk, _ = _desk(clock)
    _staged(desk, 5, 40)
    hold_id = desk.tickets.take(5)["remote_request_id"]  # type: ignore[index]
    clock.now += 20.0
    desk.notify("d0", f"HB:{hold_id}".encode())  # lease now ends at 140
    clock.now = 135.0
    desk.expire()
    assert desk.staging.num_free == BLOCKS - 2
    clock.now = 140.0
    desk.expire()
    assert desk.holds.counts.expired == 1 and desk.staging.num_free == BLOCKS - 2
    clock.now = 145.0
    desk.expire()
    assert desk.staging.num_free == BLOCKS
    desk.notify("d0", f"{hold_id}:1".encode())  # a late READ's notice: counted, no double free
    assert desk.holds.counts.unknown_notifications == 1 and desk.staging.num_free == BLOCKS


def test_blocks_return_when_the_request_ends_before_staging() -> None:
    desk, _ = _desk(FakeClock(100.0))
    assert desk.tickets.open(1)
    sender = VllmSender(desk, 1, 100)
    assert sender.poll() is KVPoll.READY and desk.staging.num_free == BLOCKS - 4
    sender.fail("aborted by the router")
    sender.close()
    assert desk.staging.num_free == BLOCKS


def test_a_front_that_gave_up_frees_the_staged_blocks() -> None:
    desk, _ = _desk(FakeClock(100.0))
    assert desk.tickets.open(1)
    sender = VllmSender(desk, 1, 20)
    assert sender.poll() is KVPoll.READY
    sender.send_pages([0, 1], 0)
    desk.tickets.take(1)  # the client went away
    sender.send_aux(0)
    wait_until(lambda: sender.poll().is_terminal, what="the repacks end")
    sender.close()
    assert sender.poll() is KVPoll.FAILED and "gave up" in (sender.failure_reason() or "")
    assert desk.staging.num_free == BLOCKS and len(desk.holds) == 0


def test_staging_full_fails_with_the_numbers_and_close_returns_everything() -> None:
    desk, _ = _desk(FakeClock(100.0))
    _staged(desk, 1, 64 * 2)  # 4 blocks held
    assert desk.tickets.open(2)
    sender = VllmSender(desk, 2, 100)
    assert sender.poll() is KVPoll.FAILED
    assert "100 tokens need 4 blocks, 2 of 6 free" in (sender.failure_reason() or "")
    desk.notify("d0", b"\xff\xfe")  # not text: counted as malformed, ignored
    assert desk.holds.counts.bad_notifications == 1
    desk.close()
    assert desk.staging.num_free == BLOCKS


class _GatedRepacker(ThreadPoolExecutor):
    """The repack thread, each repack waiting for ``gate`` first: repacks still in flight."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="test-vllm-gated")
        self.gate = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def gated() -> Any:
            assert self.gate.wait(10.0), "the test never opened the gate"
            return fn(*args, **kwargs)

        return super().submit(gated)


def test_the_answer_waits_for_every_repack_and_then_the_blocks_hold_the_kv() -> None:
    """The request succeeds (its HTTP answer, hence the decode's READ) only once every chunk's
    repack is done; the held blocks then hold the prompt's K‖V in vLLM's layout."""
    repacker = _GatedRepacker()
    desk, pool = _desk(FakeClock(100.0), repacker)
    assert desk.tickets.open(3)
    sender = VllmSender(desk, 3, 40)
    assert sender.poll() is KVPoll.READY
    sender.send_pages([4, 5], 0)  # two chunks, as the engine hands them over
    sender.send_pages([7], 2)
    sender.send_aux(0)
    assert sender.poll() is KVPoll.TRANSFERRING and len(desk.holds) == 0
    repacker.gate.set()
    wait_until(lambda: sender.poll().is_terminal, what="the repacks end")
    assert sender.poll() is KVPoll.SUCCESS and sender.transfer_stats().bytes == 40 * 2 * 2 * 4 * 4
    params = desk.tickets.take(3)
    assert params is not None
    (blocks,) = params["remote_block_ids"]
    tokens = pool[:, :, [4, 5, 7]].flatten(2, 3)[:, :, :40, 0]  # [layers, K/V, 40, head_dim]
    for layer in range(2):
        view = torch.from_numpy(desk.staging.layer_view(layer)).view(torch.float32)
        got = view[blocks, 0].flatten(0, 1)[:40]  # [40, K‖V]
        assert torch.equal(got, torch.cat([tokens[layer, 0], tokens[layer, 1]], dim=1))
    sender.close()
    repacker.shutdown()


def _tp_desk(syncs: list[int]) -> tuple[PullDesk, StageQueue]:
    """Rank 0's desk of a TP-2 worker: its pool holds head 0 of the staged 2."""
    stages = StageQueue()
    buffer = np.zeros(2 * BLOCKS * 2 * 32 * 2 * 4 * 4, dtype=np.uint8)  # L, blocks, H, bs, 2D
    group = GroupStaging(buffer, 2, range(0, 1), stages, lambda: syncs.append(1))
    return _desk(FakeClock(100.0), group=group)[0], stages


def test_at_tp_2_a_repack_waits_for_the_followers_stage() -> None:
    """A prefix hit's tokens: the leader repacks its head and queues a ``Stage`` for the
    followers; the answer waits until the step that carried it was answered, and the desk
    asks for a step while one is queued."""
    syncs: list[int] = []
    desk, stages = _tp_desk(syncs)
    assert desk.tickets.open(1, None)
    sender = VllmSender(desk, 1, 40)
    assert sender.poll() is KVPoll.READY
    sender.mirror_slots(16, 40)  # tokens 0..15: a prefix hit
    sender.send_pages([3, 4, 5], 0)
    sender.send_aux(0)
    desk.sync()
    assert syncs == [1] and stages.has_queued
    wait_until(lambda: not desk.has_repacks() or stages.has_queued, what="the leader's repack")
    assert sender.poll() is KVPoll.TRANSFERRING
    taken, futures = stages.take()
    assert taken == [Stage([3, 4, 5], 0, [0, 1], 0, 16)]
    wait_until(lambda: REPACKER.submit(lambda: None).result() is None, what="repack thread")
    assert sender.poll() is KVPoll.TRANSFERRING  # taken: the step is running
    StageQueue.done(futures)
    assert sender.poll() is KVPoll.SUCCESS
    desk.sync()
    assert syncs == [1]  # nothing queued: no step asked for


def test_at_tp_2_a_failed_group_fails_the_request_and_a_cancelled_stage_is_dropped() -> None:
    desk, stages = _tp_desk([])
    assert desk.tickets.open(1, None) and desk.tickets.open(2, None)
    failed, closed = VllmSender(desk, 1, 20), VllmSender(desk, 2, 20)
    for sender in (failed, closed):
        assert sender.poll() is KVPoll.READY
        sender.send_pages([6, 7], 0)  # nothing mirrored: all 20 tokens repacked
    taken, futures = stages.take()
    assert [s.stop for s in taken] == [20, 20]
    closing = threading.Thread(target=closed.close)  # its stage runs: close waits for it
    closing.start()
    failed.send_aux(0)
    StageQueue.fail(futures[:1], RuntimeError("the group failed"))
    wait_until(lambda: failed.poll() is KVPoll.FAILED, what="the failed stage")
    assert failed.failure_reason() == "a repack failed: the group failed"
    failed.close()
    assert closing.is_alive() and desk.staging.num_free == BLOCKS - 1  # closed's still owned
    StageQueue.done(futures[1:])
    closing.join(10)
    assert not closing.is_alive() and desk.staging.num_free == BLOCKS
    assert desk.tickets.open(3, None)
    dropped = VllmSender(desk, 3, 20)
    assert dropped.poll() is KVPoll.READY
    dropped.send_pages([6, 7], 0)
    dropped.close()  # queued, not taken: cancelled, no follower copies it
    assert stages.take() == ([], [])
    assert desk.staging.num_free == BLOCKS
