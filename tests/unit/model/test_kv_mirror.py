"""The KV mirror: a forward's ``KVCache.write`` also stores the tokens the runner names in a
second paged store of K‖V blocks (vLLM's layout), byte for byte what the pool got, in both
pool layouts; tokens not named, and writes outside ``mirroring``, leave the mirror untouched.
The copies run on the mirror's thread, and all have ended when ``mirroring`` is left, on
every path: a failed copy raises there, a failed forward still waits for its copies."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, PAGE_MAJOR, KVLayout
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.kv_mirror import KVMirror, MirrorTargets

L, H, D, PS, PAGES, BS, BLOCKS = 2, 2, 8, 4, 10, 8, 6


def _cache(kind: str, dtype: str = "bfloat16") -> KVCache:
    return KVCache(KVLayout(L, H, D, dtype, PS, PAGES, kind), torch.device("cpu"))


def _blocks(seed: int = 0) -> list[np.ndarray]:
    """Per layer [blocks, H, BS, 2D] of bf16 bits, random: a row left alone keeps its bytes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, (BLOCKS, H, BS, 2 * D), dtype=np.uint16) for _ in range(L)]


def _write_all(kv: KVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's random ``k/v [T, H, D]`` written at ``slots``; the last layer's k, v."""
    k = v = torch.empty(0)
    for layer in range(L):
        k = torch.randn(len(slots), H, D).to(torch.bfloat16)
        v = torch.randn(len(slots), H, D).to(torch.bfloat16)
        kv.write(layer, slots, k, v)
    return k, v


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("kind", [LAYER_MAJOR, PAGE_MAJOR])
def test_mirrored_rows_are_the_pool_rows_in_paired_blocks(kind: str) -> None:
    kv, blocks = _cache(kind), _blocks()
    before = [b.copy() for b in blocks]
    kv.attach_mirror(KVMirror(blocks, torch.bfloat16))
    slots = torch.tensor([37, 5, 6, 7, 20])  # pool rows (page * PS + offset)
    mirrored, mirror_slots = [5, 6, 20], [3 * BS + 7, 0 * BS + 1, 5 * BS + 0]
    targets = MirrorTargets(np.asarray(mirrored), np.asarray(mirror_slots, dtype=np.int64))
    with kv.mirroring(targets):
        _write_all(kv, slots)
    for layer in range(L):
        want = before[layer].copy()
        for pool_slot, slot in zip(mirrored, mirror_slots, strict=True):
            page, offset = divmod(pool_slot, PS)
            block, at = divmod(slot, BS)
            want[block, :, at, :D] = _bits(kv.k[layer][page, offset])  # [H, D]: K of each head
            want[block, :, at, D:] = _bits(kv.v[layer][page, offset])
        assert np.array_equal(blocks[layer], want)  # the named rows, nothing else


def test_every_row_in_order_and_nothing_outside_mirroring() -> None:
    kv, blocks = _cache(LAYER_MAJOR), _blocks(1)
    kv.attach_mirror(KVMirror(blocks, torch.bfloat16))
    slots = torch.arange(8, 13)
    _write_all(kv, slots)  # no targets: the mirror is not written
    untouched = [b.copy() for b in blocks]
    assert all(np.array_equal(a, b) for a, b in zip(blocks, _blocks(1), strict=True))
    with kv.mirroring(MirrorTargets(slots.numpy(), np.arange(BS, BS + 5))):
        k, v = _write_all(kv, slots)
    got = blocks[L - 1][1, :, :5]  # block 1, offsets 0..4: [H, 5, 2D]
    assert np.array_equal(got[..., :D], _bits(k.transpose(0, 1)))
    assert np.array_equal(got[..., D:], _bits(v.transpose(0, 1)))
    assert np.array_equal(blocks[0][[0, 2, 3, 4, 5]], untouched[0][[0, 2, 3, 4, 5]])
    assert np.array_equal(blocks[0][1, :, 5:], untouched[0][1, :, 5:])
    with kv.mirroring(None):  # a batch with no mirrored chunk
        _write_all(kv, slots)
    assert np.array_equal(blocks[L - 1][1, :, :5, :D], _bits(k.transpose(0, 1)))


@pytest.mark.parametrize("head", [0, 1])
def test_a_rank_s_mirror_writes_its_own_head_of_the_shared_blocks(head: int) -> None:
    """A tensor-parallel rank's pool holds one of the blocks' two heads: its mirror writes that
    head of the named rows and leaves the other head (another rank's) alone."""
    kv = KVCache(KVLayout(L, 1, D, "bfloat16", PS, PAGES, LAYER_MAJOR), torch.device("cpu"))
    blocks = _blocks(2)
    before = [b.copy() for b in blocks]
    kv.attach_mirror(KVMirror(blocks, torch.bfloat16, range(head, head + 1)))
    slots = torch.arange(4, 9)
    mirror_slots = np.arange(2 * BS + 3, 2 * BS + 8)
    k = v = torch.empty(0)
    with kv.mirroring(MirrorTargets(slots.numpy(), mirror_slots)):
        for layer in range(L):
            k = torch.randn(5, 1, D).to(torch.bfloat16)
            v = torch.randn(5, 1, D).to(torch.bfloat16)
            kv.write(layer, slots, k, v)
    want = before[L - 1].copy()
    want[2, head, 3:8, :D] = _bits(k[:, 0])
    want[2, head, 3:8, D:] = _bits(v[:, 0])
    assert np.array_equal(blocks[L - 1], want)


def test_a_mirror_that_does_not_fit_the_pool_is_refused() -> None:
    mla = KVCache(KVLayout(L, 1, D, "bfloat16", PS, PAGES, MLA), torch.device("cpu"))
    mirror = KVMirror(_blocks(), torch.bfloat16)
    with pytest.raises(ValueError, match="mla"):
        mla.attach_mirror(mirror)
    three_layers = KVMirror([*_blocks(), _blocks()[0]], torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(3, 2, 8\); the pool has \(2, 2, 8\)"):
        _cache(LAYER_MAJOR).attach_mirror(three_layers)
    with pytest.raises(ValueError, match="float32"):
        _cache(LAYER_MAJOR, "float32").attach_mirror(mirror)
    kv = _cache(PAGE_MAJOR)
    with (
        pytest.raises(AssertionError, match="without a mirror"),
        kv.mirroring(MirrorTargets(np.arange(2), np.arange(2))),
    ):
        pass


def _held(mirror: KVMirror) -> threading.Event:
    """Holds the mirror's thread until the event is set (a copy queued behind waits)."""
    gate = threading.Event()
    mirror.submit(lambda: gate.wait(30) and None)
    return gate


@pytest.mark.parametrize("kind", [LAYER_MAJOR, PAGE_MAJOR])
def test_the_copies_run_on_the_mirrors_thread_and_end_with_mirroring(kind: str) -> None:
    kv, blocks = _cache(kind), _blocks(2)
    mirror = KVMirror(blocks, torch.bfloat16)
    kv.attach_mirror(mirror)
    before, slots = [b.copy() for b in blocks], torch.tensor([9, 10, 11])
    gate = _held(mirror)
    with kv.mirroring(MirrorTargets(slots.numpy(), np.arange(3))) as writes:
        k, v = _write_all(kv, slots)  # returns with every copy still queued
        assert all(np.array_equal(a, b) for a, b in zip(blocks, before, strict=True))
        gate.set()
    assert writes is not None and writes.copy_s > 0
    assert torch.equal(mirror.k[L - 1][0, :3], k) and torch.equal(mirror.v[L - 1][0, :3], v)


def test_a_failed_forward_waits_for_its_copies_and_raises_its_own_error() -> None:
    kv, mirror = _cache(LAYER_MAJOR), KVMirror(_blocks(3), torch.bfloat16)
    kv.attach_mirror(mirror)
    slots = torch.tensor([1, 2])
    gate = _held(mirror)
    k = torch.randn(2, H, D).to(torch.bfloat16)
    with (
        pytest.raises(RuntimeError, match="layer 1 failed"),
        kv.mirroring(MirrorTargets(slots.numpy(), np.array([BS, BS + 1]))),
    ):
        kv.write(0, slots, k, -k)
        gate.set()
        raise RuntimeError("layer 1 failed")
    assert torch.equal(mirror.k[0][1, :2], k) and torch.equal(mirror.v[0][1, :2], -k)


def test_a_failed_copy_raises_when_mirroring_ends() -> None:
    kv, mirror = _cache(PAGE_MAJOR), KVMirror(_blocks(), torch.bfloat16)
    kv.attach_mirror(mirror)
    slots = torch.tensor([3])
    past_the_end = MirrorTargets(slots.numpy(), np.array([BLOCKS * BS]))
    with pytest.raises(IndexError), kv.mirroring(past_the_end):
        _write_all(kv, slots)
    with kv.mirroring(MirrorTargets(slots.numpy(), np.array([0]))):  # the next forward copies
        k, v = _write_all(kv, slots)
    assert torch.equal(mirror.k[L - 1][0, 0], k[0]) and torch.equal(mirror.v[L - 1][0, 0], v[0])
