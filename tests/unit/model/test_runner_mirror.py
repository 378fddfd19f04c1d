"""The runner and the KV mirror: ``pack`` names the pool rows of the mirrored chunks' tokens
and their mirror slots; a real forward (a small random Llama) writes exactly those tokens' K/V
into the mirror, byte-equal to the pool, and computes the same logits as without a mirror."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.layout import PAGE_MAJOR
from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.model.runner import Runner
from prefill_worker.request import SamplingParams
from prefill_worker.testing.random_model import random_runner

CONFIG = dict(
    architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
PS, BS, BLOCKS = 4, 8, 6
GREEDY = SamplingParams(temperature=0.0)


def _runner() -> Runner:
    cpu = torch.device("cpu")
    runner, _ = random_runner(CONFIG, torch.float32, cpu, "sdpa", PS, 16, 3, PAGE_MAJOR)
    return runner


def _mirrored(runner: Runner) -> list[np.ndarray]:
    """A mirror of ``BLOCKS`` fp32 blocks per layer, zeros, attached; its arrays."""
    lay = runner.kv_cache.layout
    shape = (BLOCKS, lay.num_kv_heads, BS, 2 * lay.head_dim)
    blocks = [np.zeros(shape, np.uint32) for _ in range(lay.num_layers)]
    runner.kv_cache.attach_mirror(KVMirror(blocks, torch.float32))
    return blocks


def _plan(a_slots: list[int], b_slots: list[int]) -> BatchPlan:
    """Request a: positions [4, 10) over pages 5, 2, 9 (its first page computed earlier);
    request b: a whole 5-token prompt over pages 7, 0. Both sample."""
    a = ChunkPlan("a", list(range(20, 26)), 4, 10, (5, 2, 9), GREEDY, mirror_slots=a_slots)
    b = ChunkPlan("b", [7, 8, 9, 10, 11], 0, 5, (7, 0), GREEDY, mirror_slots=b_slots)
    return BatchPlan(1, (a, b))


A_SLOTS = [3 * BS + 4 + i for i in range(4)] + [1 * BS + i for i in range(2)]  # blocks 3, 1
B_SLOTS = [4 * BS + i for i in range(5)]
A_POOL = [2 * PS + i for i in range(4)] + [9 * PS + i for i in range(2)]  # positions 4..9
B_POOL = [7 * PS + i for i in range(4)] + [0 * PS]  # positions 0..4


def test_pack_names_the_mirrored_tokens_pool_rows_and_slots() -> None:
    runner = _runner()
    _mirrored(runner)
    one = runner.pack(_plan([], B_SLOTS)).mirror
    assert one is not None
    assert one.pool_slots.tolist() == B_POOL and one.slots.tolist() == B_SLOTS
    both = runner.pack(_plan(A_SLOTS, B_SLOTS)).mirror
    assert both is not None
    assert both.pool_slots.tolist() == A_POOL + B_POOL and both.slots.tolist() == A_SLOTS + B_SLOTS
    assert runner.pack(_plan([], [])).mirror is None
    with pytest.raises(ValueError, match="one mirror slot per token"):
        runner.pack(_plan(A_SLOTS[:-1], []))


def test_a_forward_writes_the_mirrored_tokens_as_the_pool_holds_them() -> None:
    plain, runner = _runner(), _runner()  # the same seed: the same weights
    blocks = _mirrored(runner)
    want = plain.run(_plan([], []))
    got = runner.run(_plan(A_SLOTS, []))  # b not mirrored
    assert got.sampled == want.sampled
    kv, expected = runner.kv_cache, [np.zeros_like(b) for b in blocks]
    assert torch.equal(kv.k[1], plain.kv_cache.k[1]) and torch.equal(kv.v[0], plain.kv_cache.v[0])
    pages = (5, 2, 9)
    for layer, block_rows in enumerate(expected):
        for pos, slot in zip(range(4, 10), A_SLOTS, strict=True):
            page, offset = pages[pos // PS], pos % PS
            k = kv.k[layer][page, offset].numpy().view(np.uint32)  # [KV, D]
            v = kv.v[layer][page, offset].numpy().view(np.uint32)
            block_rows[slot // BS, :, slot % BS] = np.concatenate([k, v], axis=1)
        assert np.array_equal(blocks[layer], block_rows)  # a's tokens; b's blocks untouched
