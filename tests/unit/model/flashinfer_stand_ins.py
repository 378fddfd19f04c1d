"""Stand-ins for flashinfer's two prefill wrappers the MLA backend drives, on the CPU: their
``plan``/``run`` signatures as flashinfer-python 0.6.13 declares them (so a misnamed or
misplaced argument fails here), their checks on what they are given, and their results as
its docs define them, computed in torch. A unit seam only: the kernels are proven by the
``gpu`` tests."""

from __future__ import annotations

import itertools
from typing import Any

import torch


def _causal_softmax(scores: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``scores [n, H, m]`` of the last n queries over m keys, bottom-right causal."""
    n = scores.shape[0]
    visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - n, kv_len)[:, None]
    return scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)


class RaggedPrefill:
    """``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``."""

    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim_qk: int, head_dim_vo: int | None = None,
        custom_mask: Any = None, packed_custom_mask: Any = None, causal: bool = False,
        pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
        window_left: int = -1, logits_soft_cap: float | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, q_data_type: Any = "float16",
        kv_data_type: Any = None, o_data_type: Any = None, non_blocking: bool = True,
        prefix_len_ptr: Any = None, token_pos_in_items_ptr: Any = None,
        token_pos_in_items_len: int = 0, max_item_len_ptr: Any = None,
        fixed_split_size: int | None = None, disable_split_kv: bool = False,
        seq_lens: Any = None, seq_lens_q: Any = None, max_token_per_sequence: Any = None,
        max_sequence_kv: Any = None, v_indptr: Any = None, o_indptr: Any = None,
    ) -> None:  # fmt: skip
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32
        self.qo, self.kv = qo_indptr.tolist(), kv_indptr.tolist()
        self.heads, self.kv_heads = num_qo_heads, num_kv_heads
        self.dims = (head_dim_qk, head_dim_vo or head_dim_qk)
        self.causal, self.scale, self.dtype = causal, sm_scale, q_data_type

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
        out: torch.Tensor | None = None, lse: Any = None, return_lse: bool = False,
        enable_pdl: Any = None, kv_cache_sf: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        qo, kv, heads, (dim_qk, dim_vo), scale = self.qo, self.kv, self.heads, self.dims, self.scale
        assert not args and self.causal and heads == self.kv_heads and q.dtype == self.dtype
        assert q.shape == (qo[-1], heads, dim_qk) and k.shape == (kv[-1], heads, dim_qk)
        assert v.shape == (kv[-1], heads, dim_vo)
        result = q.new_empty(q.shape[0], heads, dim_vo) if out is None else out
        for i in range(len(qo) - 1):
            qs, ks, vs = q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]]
            weights = _causal_softmax(torch.einsum("nhd,mhd->nhm", qs, ks) * scale, len(ks))
            result[qo[i] : qo[i + 1]] = torch.einsum("nhm,mhd->nhd", weights, vs)
        return result


class PagedMLA:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (its fa2/fa3 backends)."""

    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
        page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
        kv_data_type: torch.dtype, use_profiler: bool = False,
    ) -> None:  # fmt: skip
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32
        self.qo, self.kv_indptr = qo_indptr.tolist(), kv_indptr.tolist()
        self.pages, self.kv_lens = kv_indices.tolist(), kv_len_arr.tolist()
        self.heads, self.dims, self.page_size = num_heads, (head_dim_ckv, head_dim_kpe), page_size
        self.causal, self.scale, self.dtypes = causal, sm_scale, (q_data_type, kv_data_type)

    def run(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor, out: torch.Tensor | None = None, lse: Any = None,
        return_lse: bool = False, profiler_buffer: Any = None, kv_len: Any = None,
        page_table: Any = None, return_lse_base_on_e: bool = False, o_scale: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        qo, kv_indptr, pages, kv_lens = self.qo, self.kv_indptr, self.pages, self.kv_lens
        heads, (dim_ckv, dim_kpe), ps, scale = self.heads, self.dims, self.page_size, self.scale
        assert self.causal and (q_nope.dtype, ckv_cache.dtype) == self.dtypes
        assert q_nope.shape == (qo[-1], heads, dim_ckv) and q_pe.shape == (qo[-1], heads, dim_kpe)
        assert ckv_cache.shape[1:] == (ps, dim_ckv) and kpe_cache.shape[1:] == (ps, dim_kpe)
        assert ckv_cache.stride(-1) == kpe_cache.stride(-1) == 1  # rows may be strided
        result = torch.empty_like(q_nope) if out is None else out
        for i in range(len(qo) - 1):
            keys = torch.arange(kv_lens[i])
            page = torch.tensor(pages[kv_indptr[i] : kv_indptr[i + 1]])[keys // ps]
            ckv, kpe = ckv_cache[page, keys % ps], kpe_cache[page, keys % ps]  # [m, D]
            lo, hi = qo[i], qo[i + 1]
            scores = (q_nope[lo:hi] @ ckv.T + q_pe[lo:hi] @ kpe.T) * scale  # [n, H, m]
            result[lo:hi] = _causal_softmax(scores, kv_lens[i]) @ ckv
        return result


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
    output: torch.Tensor | None = None, output_state: torch.Tensor | None = None,
    state_checkpoints: torch.Tensor | None = None, checkpoint_cu_starts: Any = None,
    checkpoint_every_n_tokens: int = 0,
) -> Any:  # fmt: skip
    """``flashinfer.gdn_prefill.chunk_gated_delta_rule``, token by token as its docs and
    reference define it: ``g`` the decay itself (not its log), the state ``[N, H, V, K]``
    (k last), GVA heads (``Hv`` a multiple of ``Hq == Hk``), q and k taken as given."""
    assert cu_seqlens is not None, "cu_seqlens is required for varlen mode"
    assert q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert g is not None and beta is not None and g.dtype == beta.dtype == torch.float32
    heads, size = v.shape[1], q.shape[2]
    assert q.shape[1] == k.shape[1] and heads % q.shape[1] == 0 and v.shape[2] == size
    assert g.shape == beta.shape == (q.shape[0], heads)
    bounds = cu_seqlens.tolist()
    if initial_state is not None:
        assert initial_state.dtype == torch.float32 and initial_state.is_contiguous()
        assert initial_state.shape == (len(bounds) - 1, heads, size, size)
    scale = scale if scale else size**-0.5
    rep = heads // q.shape[1]
    qf, kf = (t.float().repeat_interleave(rep, dim=1) for t in (q, k))
    out = torch.empty(q.shape[0], heads, size, dtype=q.dtype)
    final = torch.empty(len(bounds) - 1, heads, size, size)
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        s = torch.zeros(heads, size, size) if initial_state is None else initial_state[n].clone()
        for t in range(start, end):  # s [H, V, K]
            s = g[t][:, None, None] * s
            old = torch.einsum("hvk,hk->hv", s, kf[t])
            new = beta[t][:, None] * v[t].float() + (1 - beta[t][:, None]) * old
            s = s + torch.einsum("hv,hk->hvk", new - old, kf[t])
            out[t] = (scale * torch.einsum("hvk,hk->hv", s, qf[t])).to(q.dtype)
        final[n] = s
    return (out, final) if output_final_state else out


def interleave_moe_weights_for_sm90_mixed_gemm(weight: torch.Tensor, quant_type: str = "fp4"):
    """``flashinfer.fused_moe``'s byte interleave (a layout only the CUDA kernel reads): the
    identity here, with its checks."""
    assert weight.dtype == torch.uint8 and weight.dim() == 3 and quant_type == "fp4"
    return weight.clone()


def interleave_moe_scales_for_sm90_mixed_gemm(scales: torch.Tensor, group_size: int = 32):
    """``[E, rows, K/32]`` -> ``[E, K/128, rows * 4]``, as flashinfer 0.6.13 documents it."""
    assert scales.dtype == torch.uint8 and scales.dim() == 3 and group_size == 32
    e, rows, groups = scales.shape
    assert groups % 4 == 0, "K must be a multiple of 128"
    return scales.reshape(e, rows, groups // 4, 4).permute(0, 2, 1, 3).reshape(e, -1, rows * 4)


def cutlass_fused_moe(
    input: torch.Tensor, token_selected_experts: torch.Tensor, token_final_scales: torch.Tensor,
    fc1_expert_weights: torch.Tensor, fc2_expert_weights: torch.Tensor,
    output_dtype: torch.dtype, quant_scales: list[torch.Tensor],
    fc1_expert_biases: torch.Tensor | None = None, fc2_expert_biases: torch.Tensor | None = None,
    input_sf: Any = None, swiglu_alpha: torch.Tensor | None = None,
    swiglu_beta: torch.Tensor | None = None, swiglu_limit: torch.Tensor | None = None,
    tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0,
    cluster_size: int = 1, cluster_rank: int = 0, output: torch.Tensor | None = None,
    enable_alltoall: bool = False, use_deepseek_fp8_block_scale: bool = False,
    use_w4_group_scaling: bool = False, use_mxfp8_act_scaling: bool = False,
    min_latency_mode: bool = False, use_packed_weights: bool = False,
    tune_max_num_tokens: int = 8192, enable_pdl: bool | None = None,
    activation_type: Any = None, swizzled_input_sf: bool = True,
) -> torch.Tensor:  # fmt: skip
    """``flashinfer.fused_moe.cutlass_fused_moe``'s W4A16 path (``use_w4_group_scaling``) by
    its reference: fc1 ``[E, 2N, K/2]`` MXFP4 with the up rows first, the scales interleaved
    as above, the SwiGLU ``gate * sigmoid(alpha gate) * (up + beta)`` after clamping gate
    at ``limit`` and up to ``+-limit``, both biases, the k outputs weighted and summed."""
    from prefill_worker.model.moe.mxfp4 import dequantize_mxfp4

    assert use_w4_group_scaling and fc1_expert_weights.dtype == torch.uint8
    assert token_selected_experts.dtype == torch.int32 and token_final_scales.dtype == torch.float32
    assert output is not None and output.shape == input.shape and input.is_contiguous()
    assert swiglu_alpha is not None and swiglu_beta is not None and swiglu_limit is not None

    def dense(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        e, rows, half = weight.shape
        s = scales.view(torch.uint8).reshape(e, half // 64, rows, 4).permute(0, 2, 1, 3)
        s = s.reshape(e, rows, half // 16).to(torch.int32) - 127
        return dequantize_mxfp4(weight.reshape(e, rows, half // 16, 16), s)

    w1, w2 = dense(fc1_expert_weights, quant_scales[0]), dense(fc2_expert_weights, quant_scales[1])
    x = input.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(token_selected_experts[t].tolist()):
            h = w1[e] @ x[t] + (0 if fc1_expert_biases is None else fc1_expert_biases[e].float())
            up, gate = h.chunk(2)
            limit = float(swiglu_limit[e])
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = gate * torch.sigmoid(swiglu_alpha[e] * gate) * (up + swiglu_beta[e])
            y = w2[e] @ act + (0 if fc2_expert_biases is None else fc2_expert_biases[e].float())
            out[t] += token_final_scales[t, j] * y
    output.copy_(out.to(output_dtype))
    return output
