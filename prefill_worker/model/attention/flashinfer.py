"""The CUDA attention backend: flashinfer's batch prefill over the paged KV pool.

The pool's per-layer tensors ``[num_pages, page_size, num_kv_heads, head_dim]`` are
flashinfer's ``NHD`` paged layout as they are, so the kernel reads K/V straight from the
pages (the layer wrote this batch's K/V there first). In a page-major pool they are strided
views (pages 2L layer-pages apart): flashinfer reads a paged cache through its tensor's
strides (one set for K and V, which a layer's K and V views share), so nothing is copied.
One wrapper is planned once per batch (CSR page tables, below) and run once per layer.
Imported only when chosen, on CUDA::

    qo_indptr        [0, n0, n0+n1, ...]          query rows of each chunk
    kv_indptr        [0, p0, p0+p1, ...]          pages of each chunk, pi = ceil(end_i / ps)
    kv_indices       page ids, chunk after chunk
    kv_last_page_len end_i - (pi - 1) * ps        in [1, ps]

With ``causal=True`` flashinfer aligns the mask bottom-right, which is what a chunk
``[start, end)`` over keys ``[0, end)`` needs.

On Hopper flashinfer's ``auto`` picks its FA3 kernels without looking at the head size, and
those compile only for head sizes 64, 128 and 256 (a static assertion in ``prefill_sm90.cuh``;
seen on an H200 with a head size of 80): other sizes take the FA2 kernels, which serve any
multiple of 16.
"""

from __future__ import annotations

import flashinfer
import torch

from prefill_worker.model.attention.base import AttentionBatch
from prefill_worker.model.quant.kv import UNSCALED

WORKSPACE_BYTES = 256 * 1024 * 1024
FA3_HEAD_DIMS = (64, 128, 256)


def kernel_family(head_dim: int) -> str:
    """flashinfer's ``backend`` argument for this head size (the docstring says why)."""
    return "auto" if head_dim in FA3_HEAD_DIMS else "fa2"


class FlashInferBackend:
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        self.device = device
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._family = "auto"
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._planned_for: tuple[int, int, int, torch.dtype] | None = None
        self._batch: AttentionBatch | None = None

    def plan(self, batch: AttentionBatch) -> None:
        """Remember the batch; the wrapper is planned on the first layer, once the head
        counts and dtype are known from the tensors."""
        self._batch = batch
        self._planned_for = None

    def _plan(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        batch = self._batch
        assert batch is not None, "plan() must be called before attend()"
        qo_indptr, kv_indptr, last_page_len = [0], [0], []
        kv_indices: list[int] = []
        for span in batch.spans:
            qo_indptr.append(span.q_end)
            kv_indices.extend(span.page_ids)
            kv_indptr.append(len(kv_indices))
            last_page_len.append(span.end - (len(span.page_ids) - 1) * batch.page_size)
        family = kernel_family(head_dim)
        if family != self._family:  # the kernel family is fixed when a wrapper is made
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend=family
            )
            self._family = family
        self._wrapper.plan(  # indptr arrays on the host: planning reads them there
            _int32(qo_indptr),
            _int32(kv_indptr),
            _int32(kv_indices).to(self.device),
            _int32(last_page_len),
            num_heads,
            num_kv_heads,
            head_dim,
            batch.page_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        self._planned_for = (num_heads, num_kv_heads, head_dim, dtype)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        out: torch.Tensor,
        scales: tuple[float, float] = UNSCALED,
    ) -> None:
        key = (q.shape[1], k.shape[1], q.shape[2], q.dtype)
        if self._planned_for != key:
            self._plan(*key)
        self._wrapper.run(q, (k_pool, v_pool), out=out)


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
