"""The DSA index keys as SGLang's decode keeps them: FP8 (e4m3) with one fp32 scale per
token, in pages laid out as SGLang 0.5.23's ``DSATokenToKVPool`` index buffer, beside our
own index cache (``model.index_cache``, the model's dtype, which our attention reads).

SGLang's decode of a DSA model reads its indexer keys from that buffer; the prefill writes it.
Its index key is 128 values (``DSATokenToKVPool`` asserts ``index_head_dim == 128``), one
quantization block; a page of one indexed layer is (``index_key_cache.IndexKeyCache``)::

    bytes [0, page_size * 128)              the page's keys, token after token, e4m3 codes
    bytes [page_size * 128, page_size * 132) their scales, token after token, fp32

The rule is the one SGLang's CUDA prefill writes with (``fused_store_index_k_cache``,
``dsa/fused_store_index_cache.cuh``), on the key in fp32::

    scale = max(1e-4, max |k|) / 448          code = e4m3(clamp(k * (1 / scale), -448, 448))

rounded to nearest even (SGLang's ``act_quant`` fallback, used off CUDA, rounds the scale up
to a power of two instead; a decode dequantizes either as ``code * scale``).

Written at the forward, not at the push: the chunk's keys are at hand there, a page costs 132
bytes per token per indexed layer beside the cache (a bf16 cache's 256), and the push then
copies pages like any other paged component, with no staging to fill or to give back.
"""

from __future__ import annotations

import torch

from prefill_worker.kv.state_layout import EACH_CHUNK, PAGES, StateComponent, StateRegions
from prefill_worker.kv.state_layout import StateTensor as Tensor
from prefill_worker.model.hf_dsa import IndexerSpec

SGLANG_INDEX_DIM = 128  # SGLang's index key and its quantization block
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_BYTES = 4
INDEX_FP8 = "index_keys_fp8"  # the component's kind (SGLang's decode calls its pool "dsa")


def quantize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys [T, 128]`` (any float dtype) as SGLang stores them: e4m3 codes ``[T, 128]``
    (uint8) and scales ``[T]`` (fp32)."""
    x = keys.float()  # [T, 128]
    scale = x.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX  # [T]
    inv = 1.0 / scale
    codes = (x * inv[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a decode reads back: ``codes [T, 128]`` (uint8) times ``scale [T]``, fp32."""
    return codes.view(torch.float8_e4m3fn).float() * scale[:, None]


def page_bytes(page_size: int) -> int:
    """One page of one indexed layer: its keys then their scales."""
    return page_size * (SGLANG_INDEX_DIM + SCALE_BYTES)


def can_hold(spec: IndexerSpec) -> bool:
    """Whether SGLang's index pool can hold this model's index keys (128 values each)."""
    return spec.head_dim == SGLANG_INDEX_DIM


class IndexPages:
    """Owns the FP8 pages of every indexed layer, as many as the MLA pool (same page ids)::

    storage  [num_indexed_layers, num_pages, page_size * 132]   uint8

    Page p of indexed layer i starts at ``base_addrs()[i] + p * page_bytes``."""

    def __init__(
        self, layer_ids: tuple[int, ...], num_pages: int, page_size: int, device: torch.device
    ) -> None:
        self.layer_ids, self.page_size = layer_ids, page_size
        self._storage = torch.zeros(  # [L_idx, P, page_size * 132]
            (len(layer_ids), num_pages, page_bytes(page_size)), dtype=torch.uint8, device=device
        )
        split = page_size * SGLANG_INDEX_DIM
        self._keys = self._storage[..., :split].unflatten(-1, (page_size, SGLANG_INDEX_DIM))
        self._scales = self._storage[..., split:].unflatten(-1, (page_size, SCALE_BYTES))

    @property
    def num_bytes(self) -> int:
        return self._storage.numel()

    def write(self, slot: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Quantize ``keys [T, 128]`` of indexed layer ``slot`` (its place in ``layer_ids``)
        into flat rows ``slots [T]``."""
        codes, scale = quantize(keys)
        page, offset = slots // self.page_size, slots % self.page_size
        self._keys[slot].index_put_((page, offset), codes)
        self._scales[slot].index_put_((page, offset), scale[:, None].view(torch.uint8))

    def read(self, slot: int, page_ids: list[int]) -> torch.Tensor:
        """Pages ``page_ids`` of indexed layer ``slot``, raw: ``[len(page_ids), page_bytes]``."""
        return self._storage[slot, torch.tensor(page_ids, dtype=torch.int64)].clone()

    def regions(self, device: str) -> StateRegions:
        """The component (a page of every indexed layer per item, ``PAGES``, with each chunk)
        and where its pages live (``device`` as the KV pool names it)."""
        size = page_bytes(self.page_size)
        tensor = Tensor("index_k_fp8", (size,), "uint8", size)
        num_pages = self._storage.shape[1]
        component = StateComponent(
            INDEX_FP8, self.layer_ids, (tensor,), num_pages, PAGES, EACH_CHUNK
        )
        bases = tuple(plane.data_ptr() for plane in self._storage)
        return StateRegions(component, (bases,), device)
