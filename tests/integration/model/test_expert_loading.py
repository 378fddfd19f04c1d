"""Under expert parallelism each rank loads its routed experts whole and no other expert's
bytes, FP8 checkpoints too (no process group needed: loading involves no collective)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.model import TPGroup
from prefill_worker.model.hf_config import read_spec
from prefill_worker.model.loader import load_checkpoint
from prefill_worker.model.moe.block import MoEWeights
from prefill_worker.model.moe.placement import ExpertPlacement, make_placement
from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import make_fp8_checkpoint

CPU = torch.device("cpu")
INTERLEAVED = ExpertPlacement((1, 0) * 8, 2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep_load")
    fp8, _ = make_fp8_checkpoint("deepseek_v3", root / "fp8", block=(32, 32))
    return {"deepseek_v3": make_checkpoint("deepseek_v3", root / "bf"), "fp8": fp8}


def load(path: Path, tp: TPGroup, experts: ExpertPlacement | None, progress: list | None = None):  # type: ignore[no-untyped-def]
    on_progress = None if progress is None else lambda done, total: progress.append((done, total))
    return load_checkpoint(path, torch.float32, CPU, on_progress, tp, experts)[1]


def sparse(weights) -> list[MoEWeights]:  # type: ignore[no-untyped-def]
    return [layer.mlp for layer in weights.layers if isinstance(layer.mlp, MoEWeights)]


@pytest.mark.parametrize("name", ["deepseek_v3", "fp8"])
@pytest.mark.parametrize("placement", ["contiguous", "interleaved"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_its_experts_whole(checkpoints, name, placement, rank):
    path = checkpoints[name]
    experts = INTERLEAVED if placement == "interleaved" else make_placement(16, 2)
    whole = sparse(load(path, TPGroup(), None))
    mine = sparse(load(path, TPGroup(rank, 2), experts))
    tp_half = sparse(load(path, TPGroup(rank, 2), None))
    local = list(experts.local_experts(rank))
    assert len(local) == 8
    for full, part, half in zip(whole, mine, tp_half, strict=True):
        assert torch.equal(part.gate_up, full.gate_up[local])
        assert torch.equal(part.down, full.down[local])
        assert torch.equal(part.router, full.router)
        assert part.shared_gate_up is not None and half.shared_gate_up is not None
        assert torch.equal(part.shared_gate_up, half.shared_gate_up)  # TP-split, as at EP 1


def test_a_rank_reads_only_its_experts(checkpoints):
    """The progress count is the bytes read: at EP 2 a rank reads exactly TP 2's total (its
    half of the expert bytes, whole experts instead of half of each)."""
    path = checkpoints["deepseek_v3"]
    spec = read_spec(path)
    assert spec.moe is not None
    at_ep: list[tuple[int, int]] = []
    at_tp: list[tuple[int, int]] = []
    load(path, TPGroup(1, 2), make_placement(16, 2), at_ep)
    load(path, TPGroup(1, 2), None, at_tp)
    assert at_ep[-1][0] == at_ep[-1][1] == at_tp[-1][1]  # read all it counted, as much as TP
    lopsided: list[tuple[int, int]] = []
    load(path, TPGroup(1, 2), ExpertPlacement((0,) * 15 + (1,), 2), lopsided)
    expert = 3 * spec.moe.intermediate_size * spec.hidden_size * 4  # fp32 in the checkpoint
    num_sparse = len(spec.moe.sparse_layers)
    assert at_ep[-1][1] - lopsided[-1][1] == 7 * expert * num_sparse  # 8 experts less 1
