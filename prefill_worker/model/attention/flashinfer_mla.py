"""The CUDA MLA attention backend: flashinfer's kernels over the ``mla`` pool, in the form
``mla_plan.mla_indices`` picks per batch (its docstring has both and why)::

    ragged   k = [kv_b(latent)_nope | k_rope], v = kv_b(latent)_v  over the fresh rows;
             BatchPrefillWithRaggedKVCacheWrapper, qk width nope + rope, vo width v
    paged    q_lat = q_nope W_UK (per head),  o_lat = MLA(q_lat, q_pe; ckv, kpe pages),
             out = o_lat W_UV^T;  BatchMLAPagedAttentionWrapper

``W_UK``/``W_UV`` are ``kv_b``'s key and value halves per head (``[H, nope, r]``, ``[H, v,
r]``). The pool plane ``[P, ps, 1, r + rope]`` is read in place through two strided views
(``ckv = [..., :r]``, ``kpe = [..., r:]``): the kernel takes their page and row strides.
Both forms are causal with the mask aligned bottom-right (a chunk ``[start, end)`` over keys
``[0, end)``) and scale by ``spec.softmax_scale`` (YaRN's mscale included). Written against
flashinfer-python 0.6.13 (the GPU check's); 0.7.4 (what ``pip install .[cuda]`` gets)
declares the same names for these calls, deprecating the flat CSR ``plan`` form. Only the
``gpu``-marked tests run its kernels. Chosen on CUDA only, for a model whose shape
``mla_plan.kernel_mismatch`` accepts; flashinfer is imported by ``create``, so the rest
runs on the CPU over stand-ins for the two wrappers (``tests/unit/model``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from prefill_worker.model.attention.base import AttentionBatch
from prefill_worker.model.attention.mla_plan import RAGGED, MLAIndices, mla_indices
from prefill_worker.model.hf_config import MLASpec

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferMLABackend:
    """Built by ``create`` on CUDA; the constructor takes the two wrappers (or stand-ins with
    their 0.6.13 ``plan``/``run`` signatures, which the CPU tests use)."""

    def __init__(self, ragged: Any, paged: Any, device: torch.device) -> None:
        self.device = device
        self._ragged, self._paged = ragged, paged  # one form runs per batch
        self._batch: AttentionBatch | None = None
        self._indices: MLAIndices | None = None
        self._planned_for: tuple[int, torch.dtype] | None = None

    @classmethod
    def create(cls, device: torch.device) -> FlashInferMLABackend:
        if device.type != "cuda":
            raise ValueError("the flashinfer MLA attention backend needs a CUDA device")
        import flashinfer  # CUDA only: imported when chosen
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        return cls(ragged, BatchMLAPagedAttentionWrapper(workspace), device)

    def plan(self, batch: AttentionBatch) -> None:
        """Build the indices; the wrapper is planned on the first layer, once the head count
        and dtype are known from the tensors."""
        self._batch, self._indices = batch, mla_indices(batch.spans)
        self._planned_for = None

    def attend(self, *_: object) -> None:
        raise TypeError("an MLA pool has no K/V planes: call attend_latent")

    def attend_latent(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        pool: torch.Tensor,
        kv_b: torch.Tensor,
        spec: MLASpec,
        out: torch.Tensor,
    ) -> None:
        assert self._indices is not None, "plan() must be called before attend_latent()"
        if self._planned_for != (q.shape[1], q.dtype):
            self._plan(q.shape[1], q.dtype, spec)
        if self._indices.form == RAGGED:
            self._attend_ragged(q, rows, kv_b, spec, out)
        else:
            self._attend_paged(q, pool, kv_b, spec, out)

    def _plan(self, heads: int, dtype: torch.dtype, spec: MLASpec) -> None:
        batch, idx = self._batch, self._indices
        assert batch is not None and idx is not None
        if idx.form == RAGGED:
            self._ragged.plan(  # indptr arrays on the host: planning reads them there
                _int32(idx.qo_indptr),
                _int32(idx.kv_indptr),
                heads,
                heads,
                spec.qk_head_dim,
                head_dim_vo=spec.v_head_dim,
                causal=True,
                sm_scale=spec.softmax_scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        else:
            self._paged.plan(  # by name: 0.7 deprecates this form's positional call
                qo_indptr=_int32(idx.qo_indptr),
                kv_indptr=_int32(idx.kv_indptr),
                kv_indices=_int32(idx.kv_indices).to(self.device),
                kv_len_arr=_int32(idx.kv_lens),
                num_heads=heads,
                head_dim_ckv=spec.kv_lora_rank,
                head_dim_kpe=spec.qk_rope_head_dim,
                page_size=batch.page_size,
                causal=True,
                sm_scale=spec.softmax_scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        self._planned_for = (heads, dtype)

    def _attend_ragged(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        kv_b: torch.Tensor,
        spec: MLASpec,
        out: torch.Tensor,
    ) -> None:
        heads, nope, rank = q.shape[1], spec.qk_nope_head_dim, spec.kv_lora_rank
        kv = F.linear(rows[:, :rank], kv_b).view(-1, heads, nope + spec.v_head_dim)
        k = q.new_empty(kv.shape[0], heads, spec.qk_head_dim)  # [T, H, nope + rope]
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = rows[:, None, rank:]
        self._ragged.run(q, k, kv[..., nope:].contiguous(), out=out)

    def _attend_paged(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        kv_b: torch.Tensor,
        spec: MLASpec,
        out: torch.Tensor,
    ) -> None:
        nope, rank = spec.qk_nope_head_dim, spec.kv_lora_rank
        latent = self._paged.run(
            q_nope=absorb_query(q, kv_b, spec),  # [T, H, r]
            q_pe=q[..., nope:].contiguous(),  # [T, H, rope]
            ckv_cache=pool[:, :, 0, :rank],  # [P, ps, r], strided: rows r + rope apart
            kpe_cache=pool[:, :, 0, rank:],  # [P, ps, rope]
        )  # [T, H, r]
        out.copy_(expand_output(latent, kv_b, spec))


def absorb_query(q: torch.Tensor, kv_b: torch.Tensor, spec: MLASpec) -> torch.Tensor:
    """``q [T, H, nope + rope]`` -> ``q_nope W_UK``, ``[T, H, r]`` contiguous: its scores with
    a latent equal ``q_nope``'s with that latent's decompressed key."""
    w_uk = kv_b.view(q.shape[1], -1, spec.kv_lora_rank)[:, : spec.qk_nope_head_dim]  # [H, nope, r]
    return (
        torch.bmm(q[..., : spec.qk_nope_head_dim].transpose(0, 1), w_uk)
        .transpose(0, 1)
        .contiguous()
    )


def expand_output(latent: torch.Tensor, kv_b: torch.Tensor, spec: MLASpec) -> torch.Tensor:
    """``latent [T, H, r]`` (attention-weighted latents) -> ``[T, H, v]`` through ``W_UV``."""
    w_uv = kv_b.view(latent.shape[1], -1, spec.kv_lora_rank)[
        :, spec.qk_nope_head_dim :
    ]  # [H, v, r]
    return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _int32(values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
