"""The KV pool's memory layout, as both sides of a transfer must agree on it.

Two kinds of pool, ``kind``; a page of one layer's K (or V) is ``page_bytes`` =
``page_size × num_kv_heads × head_dim × itemsize`` bytes in both::

    layer_major  [num_layers, 2, num_pages, page_size, kv_heads, head_dim]
    page_major   [num_pages, num_layers, 2, page_size, kv_heads, head_dim]

Either way page ``p`` of layer ``l`` is at ``k_base_addrs[l] + p * page_stride_bytes``, so a
per-layer K or V view is ``[num_pages, page_size, kv_heads, head_dim]``. A transfer describes
the pool as ``num_regions`` regions of ``num_pages`` runs of ``region_page_bytes`` each: 2L
regions of one layer's page, or one region of whole pages.

A third K/V kind, ``vllm_blocks``, is vLLM's ``LBHNC`` block layout (its CPU/NIXL layout), a
page being one vLLM block (``page_size`` = the decodes' block size)::

    vllm_blocks  [num_layers, num_pages, kv_heads, page_size, 2 * head_dim]   K‖V innermost

One page of one layer is one contiguous run of ``2 * page_bytes`` (every head's K and V), so a
vLLM decode's block of a layer is one descriptor (docs/vllm.md, "A pool in vLLM's layout").
``k_base_addrs[l]`` is the layer's first byte and ``v_base_addrs[l]`` ``head_dim * itemsize``
after it; the per-layer K/V views are strided (a token ``2 * head_dim`` items after the one
before, a head ``page_size * 2 * head_dim``): ``token_stride_bytes``, ``head_stride_bytes``.
It is L regions of one layer's page each.

A multi-head latent attention (MLA) model's pool is the third kind, ``mla``: one plane per
layer, no K/V split and no heads (``num_kv_heads`` is 1, ``head_dim`` is ``kv_lora_rank +
qk_rope_head_dim``), ``[num_layers, num_pages, page_size, 1, head_dim]``; ``k_base_addrs``
holds each layer's latent, ``v_base_addrs`` is empty, and it is L regions.

The region map of each kind and the compatibility rule (``compat_hash``) are in
docs/protocol.md ("Layout and compatibility"). Torch-free: the runner fills in the
addresses of the tensors it allocated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}  # fp8: KV only
LAYER_MAJOR = "layer_major"
PAGE_MAJOR = "page_major"
VLLM_BLOCKS = "vllm_blocks"  # vLLM's LBHNC blocks: [L, P, KV, page_size, 2 * D]
POOL_LAYOUTS = (LAYER_MAJOR, PAGE_MAJOR, VLLM_BLOCKS)  # the layouts a K/V (MHA/GQA) pool may take
MLA = "mla"  # one latent plane per layer (multi-head latent attention)
KV_KINDS = (*POOL_LAYOUTS, MLA)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one side's KV pool; ``compat_hash`` ignores sizes that may differ per side."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_ITEMSIZE
    page_size: int
    num_pages: int
    kind: str = LAYER_MAJOR  # one of KV_KINDS
    # An FP8 pool's checkpoint KV scales (model.quant.kv_scales): every layer's K scale, then
    # every layer's V scale; a stored byte times its scale is the value. (): none (1.0).
    kv_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"pool layout {self.kind!r} is not one of {', '.join(KV_KINDS)}")
        if self.kind == MLA and self.num_kv_heads != 1:
            raise ValueError(
                f"an mla pool has one latent per token (num_kv_heads {self.num_kv_heads})"
            )
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_ITEMSIZE)}")
        if self.kv_scales and len(self.kv_scales) != 2 * self.num_layers:
            raise ValueError(
                f"{len(self.kv_scales)} KV scales for {self.num_layers} layers (a K and a V each)"
            )

    def scales_of(self, layer: int) -> tuple[float, float]:
        """Layer ``layer``'s (K, V) scales; (1.0, 1.0) without checkpoint scales."""
        if not self.kv_scales:
            return 1.0, 1.0
        return self.kv_scales[layer], self.kv_scales[self.num_layers + layer]

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def page_bytes(self) -> int:
        """One page of one layer's K (or V, or latent)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def planes(self) -> int:
        """Planes per layer: 2 (K and V) or 1 (an MLA latent)."""
        return 1 if self.kind == MLA else 2

    @property
    def num_regions(self) -> int:
        """Descriptor regions: 2L (layer-major), 1 (page-major) or L (mla, vllm_blocks)."""
        if self.kind == PAGE_MAJOR:
            return 1
        if self.kind == VLLM_BLOCKS:
            return self.num_layers
        return self.planes * self.num_layers

    @property
    def token_stride_bytes(self) -> int:
        """From one token's K (or V) of a head to the next token's, within a page."""
        row = self.head_dim * self.itemsize
        return 2 * row if self.kind == VLLM_BLOCKS else self.num_kv_heads * row

    @property
    def head_stride_bytes(self) -> int:
        """From one head's K (or V) of a token to the next head's, within a page."""
        row = self.head_dim * self.itemsize
        return self.page_size * 2 * row if self.kind == VLLM_BLOCKS else row

    @property
    def plane_span_bytes(self) -> int:
        """From a per-layer K (or V) view's first byte to past its last."""
        if self.kind == VLLM_BLOCKS:  # V's last row ends where the layer's region does
            return self.num_pages * self.page_stride_bytes - self.head_dim * self.itemsize
        return (self.num_pages - 1) * self.page_stride_bytes + self.page_bytes

    @property
    def region_page_bytes(self) -> int:
        """One page of one region: also the stride between pages of a per-layer view."""
        return self.page_bytes * (self.planes * self.num_layers) // self.num_regions

    @property
    def page_stride_bytes(self) -> int:
        return self.region_page_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_pages * self.region_page_bytes

    @property
    def pool_bytes(self) -> int:
        """K and V (or the latent) of every layer and page."""
        return self.num_regions * self.region_bytes

    def summary(self) -> dict[str, str | int | list[float]]:
        """What a decode needs to size a pool that can register: every field (``num_pages``
        is this side's) and the hash (``/readyz`` publishes it as ``kv_layout``)."""
        out: dict[str, str | int | list[float]] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "kind": self.kind,
            "compat_hash": self.compat_hash(),
        }
        if self.kv_scales:
            out["kv_scales"] = list(self.kv_scales)
        return out

    def compat_hash(self) -> str:
        """Equal on both sides iff pages can be copied byte for byte (num_pages may differ)
        and read back alike (the KV scales). Layer-major without scales keeps the key it had
        before page-major and scales existed."""
        key = f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}/{self.page_size}"
        if self.kind != LAYER_MAJOR:
            key += f"/{self.kind}"
        if self.kv_scales:
            key += "/scales=" + ",".join(repr(float(s)) for s in self.kv_scales)
        return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class KVRegions:
    """Where one side's pool lives: per-layer base addresses of K and V, and the aux rows.

    Raises ``ValueError`` (with the numbers) when the addresses do not fit the layout: one per
    layer; page-major, each layer's K and V where the layout puts them (``k_base_addrs[l] =
    base + 2l * page_bytes``, docs/protocol.md)."""

    layout: KVLayout
    k_base_addrs: tuple[int, ...]  # len == layout.num_layers
    v_base_addrs: tuple[int, ...]
    device: str  # "cpu" (NIXL DRAM) or "cuda:N" (NIXL VRAM on device N)
    aux_base_addr: int
    num_aux_rows: int
    # a windowed sliding pool (``cache.sliding_pool``, layer_major): each layer's page count,
    # its sliding layers' own page space; () when every layer has ``layout.num_pages``
    layer_pages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        why = addresses_error(self.layout, self.k_base_addrs, self.v_base_addrs)
        pages = self.layer_pages
        bad = pages and (self.layout.kind != LAYER_MAJOR or len(pages) != self.layout.num_layers)
        if why is None and bad:
            why = "layer_pages: one page count per layer, of a layer_major pool only"
        if why is not None:
            raise ValueError(why)

    @property
    def region_num_pages(self) -> tuple[int, ...]:
        """The pages of each descriptor region (``region_base_addrs``' order)."""
        if self.layer_pages:
            return self.layer_pages * 2  # K of every layer, then V
        return (self.layout.num_pages,) * len(self.region_base_addrs)

    @property
    def region_offsets(self) -> tuple[int, ...]:
        """Each region's first descriptor index in a region-major list of its pages."""
        counts = self.region_num_pages
        return tuple(sum(counts[:i]) for i in range(len(counts)))

    @property
    def region_base_addrs(self) -> tuple[int, ...]:
        """Where each descriptor region starts: K of every layer then V (layer-major), each
        layer's latent (mla) or K‖V (vllm_blocks), or the pool (page-major)."""
        if self.layout.kind == VLLM_BLOCKS:
            return self.k_base_addrs
        if self.layout.kind != PAGE_MAJOR:
            return self.k_base_addrs + self.v_base_addrs
        return self.k_base_addrs[:1]


def addresses_error(
    layout: KVLayout, k_base_addrs: tuple[int, ...], v_base_addrs: tuple[int, ...]
) -> str | None:
    """Why these per-layer addresses cannot describe a pool of this layout, or None."""
    n = layout.num_layers
    if layout.kind == MLA:
        if len(k_base_addrs) != n or v_base_addrs:
            return (
                f"k_base_addrs/v_base_addrs: an mla pool has one latent address per layer "
                f"({n} layers, got {len(k_base_addrs)}) and no V (got {len(v_base_addrs)})"
            )
        return None
    if len(k_base_addrs) != n or len(v_base_addrs) != n:
        return (
            f"k_base_addrs/v_base_addrs: one address per layer needed ({n} layers, got "
            f"{len(k_base_addrs)} and {len(v_base_addrs)})"
        )
    if layout.kind == VLLM_BLOCKS:
        row = layout.head_dim * layout.itemsize
        if any(v != k + row for k, v in zip(k_base_addrs, v_base_addrs, strict=True)):
            return (
                "k_base_addrs/v_base_addrs: a vllm_blocks pool puts each layer's V "
                f"head_dim * itemsize ({row}) bytes after its K; these addresses do not"
            )
    if layout.kind == PAGE_MAJOR:
        base, page = k_base_addrs[0], layout.page_bytes
        want_k = tuple(base + 2 * i * page for i in range(n))
        want_v = tuple(a + page for a in want_k)
        if k_base_addrs != want_k or v_base_addrs != want_v:
            return (
                "k_base_addrs/v_base_addrs: a page_major pool puts layer l's K at "
                f"k_base_addrs[0] + 2l * page_bytes and its V page_bytes ({page}) later; "
                "these addresses do not"
            )
    return None
