"""Each tensor-parallel rank loads only its slices of the checkpoint, fused as the model runs
them (no process group needed: loading involves no collective)."""

from __future__ import annotations

import pytest
import torch

from prefill_worker.model import TPGroup, build
from prefill_worker.model.loader import load_checkpoint
from tests.integration.model.conftest import FAMILIES

CPU = torch.device("cpu")


def load(path, tp: TPGroup, progress: list[tuple[int, int]] | None = None):  # type: ignore[no-untyped-def]
    on_progress = None if progress is None else lambda done, total: progress.append((done, total))
    return load_checkpoint(path, torch.float32, CPU, on_progress, tp)


def rows(t: torch.Tensor, count: int, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s share of ``count`` equal units (heads, or halves) along ``dim``."""
    share = count // size
    return torch.cat(t.chunk(count, dim)[rank * share : (rank + 1) * share], dim)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_its_heads_and_its_intermediate_slice(checkpoints, family, rank):
    spec, whole = load(checkpoints[family], TPGroup())
    _, part = load(checkpoints[family], TPGroup(rank, 2))
    heads, kv_heads, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    q_dim, kv_dim = heads * spec.head_dim, kv_heads * spec.head_dim
    for full, mine in zip(whole.layers, part.layers, strict=True):
        q, k, v = full.qkv.split([q_dim, kv_dim, kv_dim])
        want = [rows(q, heads, rank, 2), rows(k, kv_heads, rank, 2), rows(v, kv_heads, rank, 2)]
        assert torch.equal(mine.qkv, torch.cat(want))
        assert torch.equal(mine.o, rows(full.o, heads, rank, 2, dim=1))
        gate, up = full.mlp.gate_up.split([inter, inter])
        assert torch.equal(
            mine.mlp.gate_up, torch.cat([rows(gate, 2, rank, 2), rows(up, 2, rank, 2)])
        )
        assert torch.equal(mine.mlp.down, rows(full.mlp.down, 2, rank, 2, dim=1))
        assert torch.equal(mine.input_norm, full.input_norm)
        if spec.has_qkv_bias:
            assert full.qkv_bias is not None and mine.qkv_bias is not None
            qb, kb, vb = full.qkv_bias.split([q_dim, kv_dim, kv_dim])
            parts = [
                rows(qb, heads, rank, 2),
                rows(kb, kv_heads, rank, 2),
                rows(vb, kv_heads, rank, 2),
            ]
            assert torch.equal(mine.qkv_bias, torch.cat(parts))
    assert torch.equal(part.embed, whole.embed) and torch.equal(part.lm_head, whole.lm_head)


def test_a_rank_reads_less_than_the_whole_checkpoint(checkpoints):
    """The progress count is the bytes read: a rank reads the replicated tensors and half of
    every sharded one."""
    whole: list[tuple[int, int]] = []
    parts: list[list[tuple[int, int]]] = [[], []]
    load(checkpoints["qwen2"], TPGroup(), whole)
    for rank in (0, 1):
        load(checkpoints["qwen2"], TPGroup(rank, 2), parts[rank])
    replicated = 4 * (320 * 64 * 2 + 64 + 2 * 2 * 64)  # fp32 embed, head, final and layer norms
    assert [p[-1][0] for p in parts] == [(whole[-1][0] + replicated) // 2] * 2
    assert all(done == total for done, total in (whole[-1], *(p[-1] for p in parts)))


def test_a_model_that_does_not_split_over_the_ranks_is_refused(checkpoints):
    with pytest.raises(ValueError, match="4 attention heads do not split over 3 ranks"):
        build(checkpoints["llama"], device="cpu", num_pages=4, tp=TPGroup(0, 3))
