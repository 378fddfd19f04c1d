"""Hybrid models: the kinds of layers, and the typed state components a decode needs beside
the KV list. Torch-free vocabulary shared by the model, the pools and the transfer seam.

A hybrid model's layers are of kinds; each kind owns its pool and names what a decode must
receive from it as one ``StateComponent``::

    layer kind          what it keeps                     pool          copy    when
    full_attention      K/V of every token                KV pages      (the KV list itself)
    linear_attention    conv window + recurrent matrix    state slots   SLOT    last chunk
    sliding_attention   K/V of the last ``window`` tokens  window pages  PAGES   each chunk (later)
    sparse indexer      an index key per token (MLA)      index pages   PAGES   each chunk

The KV list holds the full-attention layers only. A component's ``kind`` is the
protocol-neutral name; each protocol maps it to its own (SGLang: ``mamba``, ``swa``, ``dsa``)
and applies its own end-state rule (SGLang's decode wants the state after the whole prompt).
The linear-attention kind and the sparse indexer's (``model.index_cache``: ``index_keys``, a
page of it lands in the decode page its KV page does) are built; sliding windows are sent as
full pages (``transfer.swa_window``).
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"

# Component kinds (what is sent), their copy unit and timing.
LINEAR_STATE = "linear_state"  # SGLang: "mamba"
SLOT, PAGES = "slot", "pages"
LAST_CHUNK, EACH_CHUNK = "last_chunk", "each_chunk"


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One tensor of a component, per layer: ``item_bytes`` per slot (or page), items
    contiguous, item i of layer l at ``base_addrs[l] + i * item_bytes``."""

    name: str  # "conv" | "recurrent"
    item_shape: tuple[int, ...]  # one item's shape, e.g. (conv_dim, kernel - 1)
    dtype: str  # "float32" | "bfloat16" | "float16"
    item_bytes: int


@dataclass(frozen=True, slots=True)
class StateComponent:
    """What a decode needs from one non-KV kind: the model layers it covers (``layer_ids``,
    model numbering), its tensors, how it is copied (``SLOT``: whole per-request slots;
    ``PAGES``: the request's pages) and when (``LAST_CHUNK`` | ``EACH_CHUNK``)."""

    kind: str
    layer_ids: tuple[int, ...]
    tensors: tuple[StateTensor, ...]
    num_items: int  # slots (or pages) in the pool
    copy: str = SLOT
    when: str = LAST_CHUNK

    @property
    def slot_bytes(self) -> int:
        """Bytes of one item over every layer and tensor."""
        return len(self.layer_ids) * sum(t.item_bytes for t in self.tensors)


@dataclass(frozen=True, slots=True)
class StateRegions:
    """Where one side's pool of a component lives: ``base_addrs[t][l]`` is item 0 of tensor
    ``t`` of the component's layer ``l``; item ``i`` is ``i * item_bytes`` after it. A
    transfer describes it as one strided run per (tensor, layer), in that order::

        run r = t * num_layers + l:  num_items items of tensors[t].item_bytes
        item i of run r  ->  descriptor index r * num_items + i

    Raises ``ValueError`` when the addresses do not fit the component."""

    component: StateComponent
    base_addrs: tuple[tuple[int, ...], ...]  # [tensor][layer]
    device: str  # "cpu" or "cuda:N", as the KV pool's

    def __post_init__(self) -> None:
        num_layers, tensors = len(self.component.layer_ids), self.component.tensors
        shape = tuple(len(addrs) for addrs in self.base_addrs)
        if shape != (num_layers,) * len(tensors):
            raise ValueError(
                f"{self.component.kind}: one address per layer ({num_layers}) for each of its "
                f"{len(tensors)} tensors; got {list(shape)}"
            )

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """(base address, item bytes) of each run, in descriptor order."""
        tensors = self.component.tensors
        return tuple(
            (addr, t.item_bytes)
            for t, addrs in zip(tensors, self.base_addrs, strict=True)
            for addr in addrs
        )

    def item_indices(self, item: int) -> tuple[int, ...]:
        """The descriptor index of ``item`` in every run (one slot, whole)."""
        num_items = self.component.num_items
        return tuple(run * num_items + item for run in range(len(self.runs)))


def mismatch(ours: StateComponent, theirs: StateComponent) -> str | None:
    """Why a peer's component cannot receive ours byte for byte (kind, layers, each tensor's
    name, item shape, dtype and bytes must be equal; item counts may differ), or None."""
    if (theirs.kind, theirs.copy, theirs.when) != (ours.kind, ours.copy, ours.when):
        return (
            f"state component {theirs.kind!r} ({theirs.copy}, {theirs.when}) is not "
            f"{ours.kind!r} ({ours.copy}, {ours.when})"
        )
    if theirs.layer_ids != ours.layer_ids:
        theirs_ids, ours_ids = list(theirs.layer_ids), list(ours.layer_ids)
        return f"{ours.kind}: layers {theirs_ids}, this worker's are {ours_ids}"
    if theirs.tensors != ours.tensors:
        return f"{ours.kind}: tensors {_tensors(theirs)}, this worker's are {_tensors(ours)}"
    return None


def _tensors(component: StateComponent) -> str:
    return ", ".join(f"{t.name} {list(t.item_shape)} {t.dtype}" for t in component.tensors)
