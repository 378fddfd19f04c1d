"""The KV pool's memory layout, as both sides of a transfer must agree on it (DESIGN §5).

Per layer ``l``, K and V are each one region of ``num_pages`` pages::

    k_base_addrs[l] ─▶ [ page 0 | page 1 | ... | page num_pages-1 ]
                          └─ page_size × num_kv_heads × head_dim × itemsize bytes

Page ``p`` of layer ``l`` starts at ``k_base_addrs[l] + p * page_bytes`` (same for V).
Torch-free: the runner fills in the addresses of the tensors it allocated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one side's KV pool; ``compat_hash`` ignores sizes that may differ per side."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_ITEMSIZE
    page_size: int
    num_pages: int

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def region_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def compat_hash(self) -> str:
        """Equal on both sides iff pages can be copied byte for byte (num_pages may differ)."""
        key = f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}/{self.page_size}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class KVRegions:
    """Where one side's pool lives: per-layer base addresses of K and V, and the aux rows."""

    layout: KVLayout
    k_base_addrs: tuple[int, ...]  # len == layout.num_layers
    v_base_addrs: tuple[int, ...]
    device: str  # "cpu" (NIXL DRAM) or "cuda:N" (NIXL VRAM on device N)
    aux_base_addr: int
    num_aux_rows: int

    def __post_init__(self) -> None:
        assert len(self.k_base_addrs) == self.layout.num_layers
        assert len(self.v_base_addrs) == self.layout.num_layers
