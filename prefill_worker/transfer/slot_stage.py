"""A hybrid model's state slots staged in a decode family's layout, as the transfer options
carry them: the seam between the state pool (which the service hands over at start-up) and a
protocol whose decodes keep the state otherwise than our pool (SGLang's ``MambaPool``:
``transfer.sglang.mamba``). Torch-free; the stage itself is the protocol's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prefill_worker.kv.state_layout import StateRegions


class SlotStage(Protocol):
    """Our state slots in a decode's layout (``sglang.mamba_stage``)."""

    def regions(self) -> StateRegions:
        """The staging pool: one slot per aux row, in the decode's layout."""
        ...

    def fill(self, slot: int, num_shares: int = 1) -> None:
        """Stage our state slot ``slot`` (the state after the whole prompt) for a decode of
        ``num_shares`` ranks (each rank's share of every item contiguous, rank after rank),
        done before it returns (the transfer reads it next)."""
        ...


@dataclass(frozen=True, slots=True)
class StagedState:
    """A hybrid linear-attention model to a protocol that takes its state staged: the model
    layers of our KV list (full attention) and the stage whose slots are written."""

    full_layers: tuple[int, ...]
    stage: SlotStage
    # The heads each tensor's leading dim is split by across a decode's ranks: the conv's
    # sub-blocks (q, k, v: each its channels and heads), then the temporal's value heads.
    conv_groups: tuple[tuple[int, int], ...] = ()  # (channels, heads) per conv sub-block
    num_value_heads: int = 1
