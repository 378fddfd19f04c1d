"""The DSA indexer's key cache: one index key per token per indexed layer, paged exactly as
the MLA pool beside it (same page ids, same page size), so a request's pages hold both::

    storage  [num_indexed_layers, num_pages, page_size, index_head_dim]   model dtype
    keys[i]  = storage[i]  (indexed layer ``spec.indexed_layers[i]``)      contiguous

Page p of indexed layer i starts at ``base_addrs[i] + p * page_bytes``. A row is the key
transformers' indexer caches (``k_norm(wk(h))``, its first ``qk_rope_head_dim`` values
rotated; GLM-5's interleaved pairs written back in place, as the MLA pool's rope part), in
the model's dtype: transformers keeps it unquantized (SGLang's FP8 index cache with one
scale per token is a decode-side layout, not this pool's: ``model.index_fp8`` keeps it beside
this cache when SGLang decodes are served, written with each ``write``).
"""

from __future__ import annotations

import torch

from prefill_worker.kv.state_layout import (
    EACH_CHUNK,
    PAGES,
    StateComponent,
    StateRegions,
    StateTensor,
)
from prefill_worker.model.hf_dsa import IndexerSpec
from prefill_worker.model.index_fp8 import IndexPages

INDEX_KEYS = "index_keys"  # the component's kind (SGLang's decode calls its pool "dsa")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class IndexCache:
    """Owns the index keys of every indexed layer; the model writes and reads them. Built
    before the model, given its pages once the KV pool is sized (``allocate``, once)."""

    def __init__(
        self, spec: IndexerSpec, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.spec, self.page_size, self.dtype, self.device = spec, page_size, dtype, device
        self._storage = torch.empty(0, dtype=dtype, device=device)
        self.keys: tuple[torch.Tensor, ...] = ()  # each [P, ps, D], once allocated
        self._slot_of_layer = {layer: i for i, layer in enumerate(spec.indexed_layers)}
        self.fp8_pages: IndexPages | None = None  # SGLang's layout of the keys (``keep_fp8``)

    @property
    def bytes_per_page(self) -> int:
        """One page of every indexed layer: what a page of the MLA pool costs beside it."""
        return len(self.spec.indexed_layers) * self.page_bytes

    def allocate(self, num_pages: int) -> None:
        """As many pages as the MLA pool (the same page ids)."""
        assert not self.keys, "the index cache is allocated once"
        self._storage = torch.zeros(  # [L_idx, P, page_size, D]
            (len(self.spec.indexed_layers), num_pages, self.page_size, self.spec.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.keys = tuple(self._storage)

    @property
    def num_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def keep_fp8(self) -> IndexPages:
        """From now on every ``write`` also lands in SGLang's FP8 layout, in as many pages
        (``model.index_fp8``); once, after ``allocate``."""
        assert self.keys and self.fp8_pages is None, "after allocate, once"
        num_pages = self.keys[0].shape[0]
        layers = self.spec.indexed_layers
        self.fp8_pages = IndexPages(layers, num_pages, self.page_size, self.device)
        return self.fp8_pages

    @property
    def page_bytes(self) -> int:
        """One page of one indexed layer."""
        return self.page_size * self.spec.head_dim * self._storage.element_size()

    def base_addrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.keys)

    def component(self) -> StateComponent:
        """What a decode needs from this cache: the request's pages of every indexed layer,
        written with each chunk's KV pages into the same decode pages (``PAGES``)."""
        item_shape = (self.page_size, self.spec.head_dim)
        tensor = StateTensor("index_k", item_shape, _DTYPE_NAMES[self.dtype], self.page_bytes)
        num_pages = self.keys[0].shape[0] if self.keys else 0
        return StateComponent(
            INDEX_KEYS, self.spec.indexed_layers, (tensor,), num_pages, PAGES, EACH_CHUNK
        )

    def regions(self, device: str) -> StateRegions:
        """The component and where its pages live (``device`` as the KV pool names it)."""
        return StateRegions(self.component(), (self.base_addrs(),), device)

    def layer_keys(self, layer: int) -> torch.Tensor:
        """The ``[P, page_size, D]`` plane of model layer ``layer`` (an indexed one)."""
        return self.keys[self._slot_of_layer[layer]]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store ``keys [T, D]`` of model layer ``layer`` at flat rows ``slots [T]``."""
        plane = self.layer_keys(layer)
        plane.index_put_((slots // self.page_size, slots % self.page_size), keys.to(plane.dtype))
        if self.fp8_pages is not None:
            self.fp8_pages.write(self._slot_of_layer[layer], slots, keys)

    def read(self, layer: int, page_ids: list[int], length: int) -> torch.Tensor:
        """Keys of positions ``[0, length)`` held in ``page_ids`` (a copy): ``[length, D]``."""
        plane = self.layer_keys(layer)
        return plane[torch.tensor(page_ids, dtype=torch.int64)].flatten(0, 1)[:length].clone()
