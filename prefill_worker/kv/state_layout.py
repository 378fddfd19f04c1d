"""Hybrid models: the kinds of layers, and the typed state components a decode needs beside
the KV list. Torch-free vocabulary shared by the model, the pools and the transfer seam.

A hybrid model's layers are of kinds; each kind owns its pool and names what a decode must
receive from it as one ``StateComponent``::

    layer kind          what it keeps                     pool          copy    when
    full_attention      K/V of every token                KV pages      (the KV list itself)
    linear_attention    conv window + recurrent matrix    state slots   SLOT    last chunk
    sliding_attention   K/V of the last ``window`` tokens  window pages  PAGES   each chunk (later)
    sparse indexer      an index key per token (MLA)      index pages   PAGES   each chunk (later)

The KV list holds the full-attention layers only. A component's ``kind`` is the
protocol-neutral name; each protocol maps it to its own (SGLang: ``mamba``, ``swa``, ``dsa``)
and applies its own end-state rule (SGLang's decode wants the state after the whole prompt).
Only the linear-attention kind is built today; the others are refused at start.
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
