"""flashinfer's MLA planning on the CPU: the index arrays (``attention.mla_plan``) read the
pool rows the torch path gathers, and the CUDA backend driving stand-ins for flashinfer's
two wrappers (``flashinfer_stand_ins``) equals the torch path in both forms. The kernels
themselves run only in the ``gpu`` tests."""

from __future__ import annotations

import logging

import pytest
import torch

from prefill_worker.model.attention import (
    AttentionBatch,
    create_mla_backend,
    resolve_mla_backend_name,
)
from prefill_worker.model.attention.flashinfer_mla import FlashInferMLABackend
from prefill_worker.model.attention.mla_plan import PAGED, RAGGED, MLAIndices, mla_indices
from prefill_worker.model.hf_config import MLASpec
from tests.attention_batches import scattered_batch
from tests.unit.model.flashinfer_stand_ins import PagedMLA, RaggedPrefill

PAGE_SIZE, NUM_PAGES, HEADS = 16, 64, 3
SPEC = MLASpec(
    q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=24, rope_interleave=True, softmax_scale=0.37,
)  # fmt: skip
CPU = torch.device("cpu")


def batch(chunks: list[tuple[int, int]]) -> tuple[AttentionBatch, torch.Tensor]:
    return scattered_batch(chunks, PAGE_SIZE, NUM_PAGES)


def kernel_rows(idx: MLAIndices, chunk: int, pool: torch.Tensor) -> torch.Tensor:
    """The rows ``[kv_lens[chunk], D]`` the paged kernel reads for a chunk (mla_plan's key
    rule: key j is row j % ps of page kv_indices[kv_indptr[chunk] + j // ps])."""
    keys = torch.arange(idx.kv_lens[chunk])
    pages = torch.tensor(idx.kv_indices[idx.kv_indptr[chunk] : idx.kv_indptr[chunk + 1]])
    return pool[pages[keys // PAGE_SIZE], keys % PAGE_SIZE, 0]


def kv_b_weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    width = SPEC.qk_nope_head_dim + SPEC.v_head_dim
    return torch.randn(HEADS * width, SPEC.kv_lora_rank, generator=g) / 4


def test_a_batch_with_a_prefix_is_paged_and_reads_what_the_torch_path_gathers():
    # a chunk after a cached prefix, a fresh prompt, a one-token chunk, a page-aligned end
    the_batch, slots = batch([(128, 200), (0, 100), (40, 41), (16, 64)])
    idx = mla_indices(the_batch.spans)
    assert idx.form == PAGED and idx.qo_indptr == (0, 72, 172, 173, 221)
    assert idx.kv_lens == (200, 100, 41, 64)
    assert idx.kv_indptr == (0, 13, 20, 23, 27)
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(NUM_PAGES, PAGE_SIZE, 1, SPEC.latent_dim, generator=g)
    flat = pool.view(-1, SPEC.latent_dim)
    for i, span in enumerate(the_batch.spans):  # the runner's and the torch path's rows
        page = torch.tensor(span.page_ids)[torch.arange(span.end) // PAGE_SIZE]
        expected = flat[page * PAGE_SIZE + torch.arange(span.end) % PAGE_SIZE]
        torch.testing.assert_close(kernel_rows(idx, i, pool), expected, atol=0, rtol=0)
        new_rows = flat[slots[span.q_start : span.q_end]]
        torch.testing.assert_close(kernel_rows(idx, i, pool)[span.start :], new_rows)


def test_fresh_prompts_are_ragged_over_their_own_rows():
    the_batch, _ = batch([(0, 100), (0, 37)])
    idx = mla_indices(the_batch.spans)
    assert idx == MLAIndices(RAGGED, (0, 100, 137), (0, 100, 137), (), (100, 37))


@pytest.mark.parametrize(
    "chunks",
    [[(0, 100), (0, 37)], [(128, 200), (0, 100), (40, 41), (16, 64)]],
    ids=["ragged", "paged"],
)
def test_the_flashinfer_backend_over_stand_ins_equals_the_torch_path(chunks):
    """The CUDA backend's planning and its use of both wrappers (the absorbed form's
    ``q_nope W_UK`` in and ``W_UV`` out, the strided pool views), over CPU stand-ins with
    flashinfer's signatures and results, give the torch path's outputs (fp32, 1e-4)."""
    the_batch, slots = batch(chunks)
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(NUM_PAGES, PAGE_SIZE, 1, SPEC.latent_dim, generator=g)
    q = torch.randn(the_batch.num_tokens, HEADS, SPEC.qk_head_dim, generator=g)
    rows = pool.view(-1, SPEC.latent_dim)[slots]  # this batch's rows, already in the pool
    torch_path = create_mla_backend("sdpa", CPU, SPEC, torch.float32)
    flashinfer = FlashInferMLABackend(RaggedPrefill(), PagedMLA(), CPU)
    outputs = []
    for backend in (torch_path, flashinfer):
        backend.plan(the_batch)
        outputs.append(q.new_empty(q.shape[0], HEADS, SPEC.v_head_dim))
        backend.attend_latent(q, rows, pool, kv_b_weights(), SPEC, outputs[-1])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


DEEPSEEK = MLASpec(None, 512, 128, 64, 128, True, 0.1)


@pytest.mark.parametrize(
    ("name", "spec", "dtype", "chosen"),
    [
        ("flashinfer", DEEPSEEK, torch.bfloat16, "flashinfer"),
        ("flashinfer", DEEPSEEK, torch.float32, "sdpa"),  # the kernels take half precision
        ("flashinfer", SPEC, torch.bfloat16, "sdpa"),  # not the shape they are built for
        ("sdpa", DEEPSEEK, torch.bfloat16, "sdpa"),
    ],
)
def test_flashinfer_is_kept_for_an_mla_model_only_where_its_kernels_apply(
    caplog, name, spec, dtype, chosen
):
    with caplog.at_level(logging.WARNING):
        assert resolve_mla_backend_name(name, spec, dtype) == chosen
    assert ("MLA kernels do not apply" in caplog.text) == (name != chosen)


def test_an_mla_model_on_the_cpu_keeps_the_torch_path():
    from prefill_worker.model.attention.sdpa_mla import MLASdpaBackend

    assert isinstance(create_mla_backend("auto", CPU, DEEPSEEK, torch.bfloat16), MLASdpaBackend)
