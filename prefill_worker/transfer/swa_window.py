"""Which of a request's pages each layer of a sliding-window model sends: the wire-facing
choice of the ``swa`` component, kept apart so that the transfer's state-component seam calls
it rather than restating it. Pure functions, no torch.

Two modes, after what the decode holds:

- ``full_pool``: the decode keeps every layer's K/V for every position (SGLang with hybrid
  SWA memory off): every layer sends the pages from the decode's
  first missing page on, as a dense model does.
- ``window``: the decode keeps a sliding layer's last window only (SGLang's hybrid SWA pool,
  its ``swa`` state type): a sliding layer sends the pages covering
  ``[window_start, seq_len)``, ``window_start = max(prefix_len, seq_len - window_tokens)``
  rounded down to a page boundary, as SGLang 0.5.23's prefill builds its swa payload
  (``disaggregation/prefill.py``, ``_swa_payload``); full layers send as in ``full_pool``.
  ``window_tokens`` is what the decode's model keeps: SGLang's gpt-oss
  ``get_attention_sliding_window_size`` is ``sliding_window - 1`` (a query sees itself and
  the ``window - 1`` keys before it).

SGLang's protocol sends ``window`` to a decode that registered a hybrid SWA pool
(``transfer/sglang/swa.py``) and ``full_pool`` to one without. Such a decode's want
(``WindowWant``: its window's pages in that pool, ``window_slots``) and its pool (a paged
state component of kind ``SWA_KIND``; ``swa_pool_regions``: as a KV pool of the sliding
layers) are read here too, by the leader's route and by every rank of a tensor-parallel
group (``transfer/nixl/rank_backend.py``: each writes its heads of the window).

``guard_unproven`` wraps the backend of every protocol whose sends of a sliding-window model
are not proven against its decode (every one but ``PROVEN_PROTOCOLS``) in ``StateGuard``:
each room is refused when its decode claims it, with ``refusal(...)``
(``swa_unsupported: ...``), before a byte is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout, KVRegions
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import TransferBackend
from prefill_worker.transfer.state_guard import StateGuard

# sends of a sliding-window model, decode-tested; vLLM's backend refuses the versions and
# modes it has not proven itself (``transfer/vllm/groups.py``, ``Tickets.why_refused``)
PROVEN_PROTOCOLS = ("native", "sglang", "vllm")
FULL_POOL = "full_pool"
WINDOW = "window"
SWA_UNSUPPORTED = "swa_unsupported"
SWA_KIND = "sliding_window_kv"  # SGLang's "swa" state type: a decode's hybrid SWA pool


class WindowWant(wire.Want, frozen=True, tag="window_want"):
    """A want whose decode holds a hybrid SWA pool: also the window's pages in that pool,
    packed int32 like ``dst_page_ids`` (tagged apart: a group's mirror carries it to every
    rank, ``transfer/group.py``)."""

    packed_dst_window_pages: bytes = b""

    @property
    def dst_window_pages(self) -> np.ndarray:
        return np.frombuffer(self.packed_dst_window_pages, dtype="<i4")


@dataclass(frozen=True, slots=True)
class SlidingLayers:
    """A sliding-window model as a transfer sees it: which of its ``num_layers`` layers
    slide, and ``window_tokens``, what a decode's sliding layer keeps of them."""

    sliding: tuple[int, ...]
    num_layers: int
    window_tokens: int
    # a windowed sliding pool (``cache.sliding_pool``): the sliding layers' own page count,
    # a request's window then read from its sliding pages; 0: they share the pool's pages
    pool_pages: int = 0

    @property
    def full(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.sliding)


def decode_window_tokens(sliding_window: int) -> int:
    """The tokens a decode's sliding layer keeps for a model whose config says
    ``sliding_window`` (keys a query sees, itself included)."""
    return sliding_window - 1


def layer_pages(
    seq_len: int,
    page_size: int,
    prefix_len: int,
    window_tokens: int | None,
    mode: str,
) -> range:
    """Indices into the request's page list that one layer sends: ``window_tokens`` None for
    a full layer; ``prefix_len`` tokens the decode already holds (a prefix hit there)."""
    if mode not in (FULL_POOL, WINDOW):
        raise ValueError(f"unknown swa send mode {mode!r} (known: {FULL_POOL}, {WINDOW})")
    if not 0 <= prefix_len <= seq_len or page_size < 1:
        raise ValueError(f"bad request span: prefix {prefix_len}, length {seq_len}")
    end = -(-seq_len // page_size)
    first = prefix_len // page_size
    if window_tokens is None or mode == FULL_POOL:
        return range(first, end)
    start = max(prefix_len, seq_len - window_tokens)
    return range(start // page_size, end)


def window_slots(
    window_pages: np.ndarray, num_prompt_pages: int, first_page: int, num_pages: int
) -> tuple[np.ndarray, np.ndarray]:
    """Which of a chunk's ``num_pages`` pages (prompt pages from ``first_page``) a decode's
    hybrid SWA pool keeps, and where: (a mask over the chunk's pages, their pages in the SWA
    pool). The window is the prompt's last ``len(window_pages)`` pages, page for page (its
    length checked against ``layer_pages`` when the want was bound)."""
    offsets = np.arange(first_page, first_page + num_pages) - (num_prompt_pages - len(window_pages))
    kept = offsets >= 0
    return kept, np.asarray(window_pages)[offsets[kept]]


def swa_pool_regions(pool: StateRegions) -> KVRegions:
    """A hybrid SWA pool (its component's tensors K and V, items of one page
    ``[page_size, heads, head_dim]``) as a layer-major KV pool of the sliding layers, its
    items its pages: what head slices and page copies address (``transfer.headplan``)."""
    component = pool.component
    page_size, num_heads, head_dim = component.tensors[0].item_shape
    layout = KVLayout(
        len(component.layer_ids),
        num_heads,
        head_dim,
        component.tensors[0].dtype,
        page_size,
        component.num_items,
        LAYER_MAJOR,
    )
    k_bases, v_bases = pool.base_addrs
    return KVRegions(layout, tuple(k_bases), tuple(v_bases), pool.device, 0, 0)


def pages_sent(
    windows: Sequence[int | None], seq_len: int, page_size: int, prefix_len: int, mode: str
) -> int:
    """Layer-pages a request sends over every layer (``windows``: each layer's
    ``window_tokens``, None for a full layer); times one layer-page's bytes, its bytes."""
    return sum(len(layer_pages(seq_len, page_size, prefix_len, w, mode)) for w in windows)


def refusal(protocol: str) -> str:
    return (
        f"{SWA_UNSUPPORTED}: the {protocol} protocol's sends of a sliding-window model are not "
        "proven against its decode; serve it over native (docs/models.md)"
    )


def guard_unproven(backends: Mapping[str, TransferBackend]) -> dict[str, TransferBackend]:
    """``backends`` with every protocol outside ``PROVEN_PROTOCOLS`` refusing its rooms."""
    return {
        name: backend if name in PROVEN_PROTOCOLS else StateGuard(backend, refusal(name))
        for name, backend in backends.items()
    }
