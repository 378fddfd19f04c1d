"""The torch MLA attention backend (CPU and CUDA): planned as ``SdpaBackend``, attending
over decompressed latents (``model.mla`` has the algebra, docs/models.md the choice of form)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefill_worker.model.attention.sdpa import SdpaBackend, _Planned
from prefill_worker.model.hf_config import MLASpec
from prefill_worker.model.quant.kv import from_pool


class MLASdpaBackend(SdpaBackend):
    """The MLA attention backend (CPU and CUDA, torch SDPA): planned as ``SdpaBackend``
    (fresh rows for a chunk from position 0; otherwise the prefix's pool rows ``[0, start)``
    and its own fresh rows, and a bottom-right causal mask), attending over decompressed
    latents. ``attend`` (K/V planes) is not used: an MLA pool has none."""

    def attend_latent(
        self,
        q: torch.Tensor,  # [T, H, nope + rope], RoPE applied
        rows: torch.Tensor,  # [T, r + rope], this batch's fresh pool rows
        pool: torch.Tensor,  # [P, page_size, 1, r + rope], rows written
        kv_b: torch.Tensor,  # [H (nope + v), r]
        spec: MLASpec,
        out: torch.Tensor,  # [T, H, v], written
    ) -> None:
        for p in self._planned:
            self._attend_chunk(p, q, rows, pool, kv_b, spec, p.mask, out)

    @staticmethod
    def _attend_chunk(
        p: _Planned,
        q: torch.Tensor,  # [T, H, nope + rope], RoPE applied
        rows: torch.Tensor,  # [T, r + rope], this batch's fresh pool rows
        pool: torch.Tensor,  # [P, page_size, 1, r + rope], rows written
        kv_b: torch.Tensor,  # [H (nope + v), r]
        spec: MLASpec,
        mask: torch.Tensor | None,  # [n, end] bool, True = may attend; None: plain causal
        out: torch.Tensor,  # [T, H, v], the chunk's rows written
    ) -> None:
        """One planned chunk's attention over its prefix's latents, under ``mask``."""
        heads, nope, rank = q.shape[1], spec.qk_nope_head_dim, spec.kv_lora_rank
        # [m, r + rope]: the prefix's rows [0, start) from its pages, then its own fresh ones
        chunk_rows = rows[p.q_start : p.q_end]
        if p.kv_rows is not None:
            chunk_rows = torch.cat([from_pool(pool[p.kv_rows][:, 0], q.dtype), chunk_rows])
        kv = F.linear(chunk_rows[:, :rank], kv_b).view(-1, heads, nope + spec.v_head_dim)
        k = q.new_empty(kv.shape[0], heads, spec.qk_head_dim)  # [m, H, nope + rope]
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = chunk_rows[:, None, rank:]
        v = kv[..., nope:]  # [m, H, v]
        if v.shape[-1] != k.shape[-1] and v.device.type == "cpu" and v.dtype != torch.float32:
            # The CPU's flash kernel wants one head dim for q, k and v (else SDPA falls back
            # to math, ~4x slower at 1k tokens): v padded with zeros, which add nothing. Only
            # in 16-bit dtypes (where it accumulates in fp32, as math does not): fp32 keeps
            # the math path, whose rounding the 1e-4 checks against transformers hold (the
            # flash kernel's blocked softmax was seen 1.2e-4 off a TP-2 MLA latent).
            v = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
        # [1, H, len, D]: 4-D, so that the CPU's flash kernel runs (3-D falls back to math)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q[p.q_start : p.q_end], k, v))
        attn = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=spec.softmax_scale
        )
        out[p.q_start : p.q_end] = attn[0, :, :, : spec.v_head_dim].transpose(0, 1)
