"""The KV mirror: a forward's ``KVCache.write`` also stores the rows the runner names in a
second paged store of K‖V blocks (vLLM's layout), byte for byte what the pool got, in both
pool layouts; rows not named, and writes outside ``mirroring``, leave the mirror untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, PAGE_MAJOR, KVLayout
from prefill_worker.model.kv_cache import KVCache, KVMirror, MirrorTargets

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
    rows, mirror_slots = [1, 2, 4], [3 * BS + 7, 0 * BS + 1, 5 * BS + 0]
    targets = MirrorTargets(torch.tensor(rows), np.asarray(mirror_slots, dtype=np.int64))
    with kv.mirroring(targets):
        _write_all(kv, slots)
    for layer in range(L):
        want = before[layer].copy()
        for row, slot in zip(rows, mirror_slots, strict=True):
            page, offset = divmod(int(slots[row]), PS)
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
    with kv.mirroring(MirrorTargets(None, np.arange(BS, BS + 5))):
        k, v = _write_all(kv, slots)
    got = blocks[L - 1][1, :, :5]  # block 1, offsets 0..4: [H, 5, 2D]
    assert np.array_equal(got[..., :D], _bits(k.transpose(0, 1)))
    assert np.array_equal(got[..., D:], _bits(v.transpose(0, 1)))
    assert np.array_equal(blocks[0][[0, 2, 3, 4, 5]], untouched[0][[0, 2, 3, 4, 5]])
    assert np.array_equal(blocks[0][1, :, 5:], untouched[0][1, :, 5:])
    with kv.mirroring(None):  # a batch with no mirrored chunk
        _write_all(kv, slots)
    assert np.array_equal(blocks[L - 1][1, :, :5, :D], _bits(k.transpose(0, 1)))


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
        kv.mirroring(MirrorTargets(None, np.arange(2))),
    ):
        pass
