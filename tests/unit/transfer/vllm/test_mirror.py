"""Staging by the forward (the runner's KV mirror over the staging region): a request whose
chunks were all planned after its claim queues no repack and answers right after its last
forward; a prefix hit, or a chunk computed before the claim, is repacked exactly (those
tokens, no others); either way the held blocks hold the prompt's K‖V byte for byte."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.transfer.base import KVPoll, MirroringSender
from prefill_worker.transfer.vllm.desk import PullDesk, StageCounts
from prefill_worker.transfer.vllm.sender import VllmSender
from prefill_worker.transfer.vllm.staging import block_slots
from tests.clocks import FakeClock
from tests.polling import wait_until
from tests.unit.transfer.vllm.test_sender import _desk, _GatedRepacker

PAGES = (4, 5, 7)  # the request's pool pages (16 tokens each)
NUM_TOKENS = 40


def _forward(desk: PullDesk, pool: torch.Tensor, start: int, slots: Sequence[int]) -> None:
    """What a mirrored forward writes for positions [start, start + len(slots)): each one's
    K and V (as the pool holds them) at its slot, through the runner's own mirror."""
    lay = desk.staging.layout
    layers = [desk.staging.layer_view(i) for i in range(lay.num_layers)]
    mirror = KVMirror(layers, torch.float32)
    positions = torch.arange(start, start + len(slots))
    pages, offsets = torch.tensor(PAGES)[positions // 16], positions % 16
    index = mirror.index_of(np.asarray(slots, dtype=np.int64))
    for layer in range(lay.num_layers):
        k, v = pool[layer, 0, pages, offsets], pool[layer, 1, pages, offsets]  # [T, H, D]
        mirror.write(layer, index, k, v)


def _assert_staged(desk: PullDesk, pool: torch.Tensor, room: int) -> None:
    """The held blocks hold every prompt token's K‖V."""
    params = desk.tickets.take(room)
    assert params is not None
    (blocks,) = params["remote_block_ids"]
    tokens = pool[:, :, list(PAGES)].flatten(2, 3)[:, :, :NUM_TOKENS, 0]  # [L, K/V, n, D]
    for layer in range(2):
        view = torch.from_numpy(desk.staging.layer_view(layer)).view(torch.float32)
        got = view[blocks, 0].flatten(0, 1)[:NUM_TOKENS]  # [n, K‖V]
        assert torch.equal(got, torch.cat([tokens[layer, 0], tokens[layer, 1]], dim=1))


def _ready(desk: PullDesk, room: int) -> VllmSender:
    assert desk.tickets.open(room)
    sender = VllmSender(desk, room, NUM_TOKENS)
    assert sender.poll() is KVPoll.READY and isinstance(sender, MirroringSender)
    return sender


def test_a_fully_mirrored_request_queues_no_repack_and_answers_at_once() -> None:
    repacker = _GatedRepacker()  # never opened: a repack would hold the answer back
    desk, pool = _desk(FakeClock(100.0), repacker)
    sender = _ready(desk, 3)
    for start, end, first_page in ((0, 32, 0), (32, NUM_TOKENS, 2)):  # two chunks
        slots = sender.mirror_slots(start, end)
        _forward(desk, pool, start, slots)
        sender.send_pages(PAGES[first_page : -(-end // 16)], first_page)
    sender.send_aux(0)
    assert sender.poll() is KVPoll.SUCCESS and not desk.has_repacks()
    assert desk.counts == StageCounts(mirrored_tokens=NUM_TOKENS, repacked_tokens=0, repacks=0)
    assert sender.transfer_stats().bytes == NUM_TOKENS * desk.staging.layout.token_bytes
    _assert_staged(desk, pool, 3)
    assert sender.mirror_slots(0, 1) == ()  # held: the blocks are the decode's now
    sender.close()
    repacker.gate.set()
    repacker.shutdown()


def test_a_prefix_hit_repacks_exactly_the_hit_pages() -> None:
    """A 16-token hit (page 4) into the first half of block 0; the forward mirrors the rest,
    including block 0's second half: the answer waits for the one repack, of 16 tokens."""
    repacker = _GatedRepacker()
    desk, pool = _desk(FakeClock(100.0), repacker)
    sender = _ready(desk, 4)
    slots = sender.mirror_slots(16, NUM_TOKENS)  # the first computed chunk, planned
    sender.send_pages(PAGES[:1], 0)  # its launch hands over the hit
    _forward(desk, pool, 16, slots)
    sender.send_pages(PAGES[1:], 1)
    sender.send_aux(0)
    assert sender.poll() is KVPoll.TRANSFERRING and len(desk.holds) == 0
    assert desk.counts == StageCounts(mirrored_tokens=24, repacked_tokens=16, repacks=1)
    repacker.gate.set()
    wait_until(lambda: sender.poll().is_terminal, what="the repack ends")
    assert sender.poll() is KVPoll.SUCCESS
    assert sender.transfer_stats().bytes == NUM_TOKENS * desk.staging.layout.token_bytes
    _assert_staged(desk, pool, 4)
    sender.close()
    repacker.shutdown()


def test_chunks_planned_before_the_claim_are_repacked() -> None:
    """No blocks yet: ``mirror_slots`` says () and the forward writes only the pool; once
    claimed, the computed pages are repacked and the rest mirrored."""
    desk, pool = _desk(FakeClock(100.0))
    sender = VllmSender(desk, 5, NUM_TOKENS)
    assert sender.poll() is KVPoll.BOOTSTRAPPING and sender.mirror_slots(0, 32) == ()
    assert desk.tickets.open(5) and sender.poll() is KVPoll.READY
    sender.send_pages(PAGES[:2], 0)  # the claim hands over what was computed
    _forward(desk, pool, 32, sender.mirror_slots(32, NUM_TOKENS))
    sender.send_pages(PAGES[2:], 2)
    sender.send_aux(0)
    wait_until(lambda: sender.poll().is_terminal, what="the repack ends")
    assert sender.poll() is KVPoll.SUCCESS
    assert desk.counts == StageCounts(mirrored_tokens=8, repacked_tokens=32, repacks=1)
    _assert_staged(desk, pool, 5)
    sender.close()


def test_block_slots_follow_the_request_blocks() -> None:
    assert block_slots((2, 5), 32, 30, 34) == [2 * 32 + 30, 2 * 32 + 31, 5 * 32, 5 * 32 + 1]
    assert block_slots((3,), 32, 0, 0) == []
