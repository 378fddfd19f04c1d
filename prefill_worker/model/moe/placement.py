"""Expert placement under expert parallelism: which rank holds which routed expert.

Under expert parallelism (EP) of ``size`` ranks each routed expert lives whole on exactly one
rank (no redundant replicas yet: EPLB-style duplicated hot experts are a later step). The
placement is an owner table, one rank per expert::

    contiguous (the default)   E 8 at EP 2:  experts 0..3 -> rank 0, 4..7 -> rank 1
                               (rank r: [r E / N, (r + 1) E / N); N must divide E)
    explicit map               ``parallel.expert_placement: [0, 1, 0, 1, ...]``, one rank per
                               expert; every rank must own at least one

A rank's experts are numbered locally in global order: ``local_experts(r)`` is the sorted list
of the experts it owns, and its stacked weights hold them in that order. Torch-free, so
``check-config`` and the start-up checks read it without loading anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefill_worker.model.hf_config import ModelSpec

EP_FAMILIES = ("qwen3_moe", "deepseek_v3")  # the MoE families with a tensor-parallel table


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """``owner[e]``: the rank of ``size`` that holds routed expert ``e``."""

    owner: tuple[int, ...]
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"expert-parallel size {self.size} is not a size")
        bad = [rank for rank in self.owner if not 0 <= rank < self.size]
        if bad:
            raise ValueError(
                f"expert placement names rank {bad[0]}, not one of the {self.size} EP ranks"
            )
        idle = sorted(set(range(self.size)) - set(self.owner))
        if idle:
            raise ValueError(
                f"expert placement gives rank {idle[0]} no expert (each of the {self.size} "
                f"EP ranks must own at least one of the {len(self.owner)})"
            )

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The experts ``rank`` holds, in global order (its local numbering)."""
        return tuple(e for e, owner in enumerate(self.owner) if owner == rank)

    def max_local(self) -> int:
        """The most experts any one rank holds (what memory must be sized for)."""
        return max(len(self.local_experts(rank)) for rank in range(self.size))


def contiguous(num_experts: int, size: int) -> ExpertPlacement:
    """Rank r holds experts ``[r E / N, (r + 1) E / N)``; ``N`` must divide ``E``."""
    if num_experts % size:
        raise ValueError(
            f"{num_experts} routed experts do not split over {size} expert-parallel ranks "
            f"(give parallel.expert_placement, one rank per expert)"
        )
    share = num_experts // size
    return ExpertPlacement(tuple(e // share for e in range(num_experts)), size)


def make_placement(num_experts: int, size: int, explicit: Sequence[int] = ()) -> ExpertPlacement:
    """The configured placement: ``explicit`` (one rank per expert) when given, else
    contiguous. ``ValueError`` (a configuration problem) with the reason otherwise."""
    if not explicit:
        return contiguous(num_experts, size)
    if len(explicit) != num_experts:
        raise ValueError(
            f"parallel.expert_placement names {len(explicit)} experts; the model routes "
            f"{num_experts}"
        )
    return ExpertPlacement(tuple(explicit), size)


def check_expert_parallel(
    spec: ModelSpec, tp_size: int, ep_size: int, explicit: Sequence[int] = (), dp_size: int = 1
) -> ExpertPlacement | None:
    """The placement a worker of ``dp_size`` attention ranks of ``tp_size`` ranks each runs
    ``spec``'s experts with at ``ep_size`` (None: no expert parallelism); ``ValueError`` with
    the reason when it cannot (a configuration problem, exit 78, before any rank starts).
    The experts are placed over every rank: ``ep_size`` is ``tp_size`` (one TP group) or
    ``dp_size`` (attention-DP ranks, each TP 1; DP x TP is not built)."""
    if ep_size == 1:
        if explicit:
            raise ValueError("parallel.expert_placement needs parallel.ep_size above 1")
        return None
    if dp_size > 1 and ep_size != dp_size * tp_size:
        raise ValueError(
            f"parallel.ep_size {ep_size} must be 1 or parallel.dp_size ({dp_size}) x tp_size "
            f"({tp_size}): experts are placed over every attention-DP rank"
        )
    if dp_size == 1 and ep_size != tp_size:
        raise ValueError(
            f"parallel.ep_size {ep_size} must be 1 or parallel.tp_size ({tp_size}): experts "
            f"are placed over the tensor-parallel group's ranks"
        )
    if spec.moe is None or spec.family not in EP_FAMILIES:
        raise ValueError(
            f"parallel.ep_size {ep_size}: expert parallelism serves the MoE families "
            f"{', '.join(EP_FAMILIES)}, not {spec.architecture} (family {spec.family!r})"
        )
    return make_placement(spec.moe.num_experts, ep_size, explicit)
