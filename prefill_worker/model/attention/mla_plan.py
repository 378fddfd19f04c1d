"""What flashinfer's MLA prefill is planned with, built without torch so that the CPU tests
check it against the torch path's gather (``tests/unit/model/test_mla_plan.py``).

Two forms, one per batch (``mla_indices``), as SGLang's flashinfer MLA backend chooses them:

    ragged   every chunk starts at position 0: decompressed multi-head attention over the
             chunk's own fresh rows (flashinfer's ragged prefill, qk width nope + rope, vo
             width v). qo_indptr = kv_indptr = [0, n0, n0+n1, ...]; no page is read.
    paged    some chunk reads earlier positions (a later chunk, a prefix hit): the absorbed
             form over the pool's pages in place (flashinfer's paged MLA kernel)
               qo_indptr   [0, n0, n0+n1, ...]        query rows of each chunk
               kv_indptr   [0, p0, p0+p1, ...]        pages of each chunk, pi = ceil(end_i / ps)
               kv_indices  page ids, chunk after chunk
               kv_lens     [end_0, end_1, ...]        keys of each chunk (its prompt prefix)
             key j of chunk i is row j % ps of page kv_indices[kv_indptr[i] + j // ps].

A whole prompt costs about twice as much absorbed as decompressed (docs/models.md), which is
why a batch of fresh prompts is not planned paged; with a prefix the new tokens are fewer
than the keys and the absorbed form costs about the same while reading the pool in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefill_worker.model.attention.base import ChunkSpan

RAGGED, PAGED = "ragged", "paged"
# The one MLA shape flashinfer's kernels are built and tested for (DeepSeek-V2/V3, Kimi-K2,
# Moonlight): kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim.
KERNEL_DIMS = (512, 64, 128, 128)
KERNEL_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class MLAIndices:
    form: str  # RAGGED | PAGED
    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]  # ragged: key rows; paged: pages
    kv_indices: tuple[int, ...]  # paged: page ids; ragged: ()
    kv_lens: tuple[int, ...]  # keys of each chunk


def mla_indices(spans: Sequence[ChunkSpan]) -> MLAIndices:
    """The batch's form and index arrays (module docstring)."""
    qo_indptr = (0, *(span.q_end for span in spans))
    kv_lens = tuple(span.end for span in spans)
    if all(span.start == 0 for span in spans):
        return MLAIndices(RAGGED, qo_indptr, qo_indptr, (), kv_lens)
    kv_indptr, kv_indices = [0], list[int]()
    for span in spans:
        kv_indices.extend(span.page_ids)  # exactly ceil(end / page_size)
        kv_indptr.append(len(kv_indices))
    return MLAIndices(PAGED, qo_indptr, tuple(kv_indptr), tuple(kv_indices), kv_lens)


def kernel_mismatch(dims: tuple[int, int, int, int], dtype: str) -> str | None:
    """Why flashinfer's MLA kernels do not apply to a model of ``dims`` (``KERNEL_DIMS``'
    order) in ``dtype``, or None when they do."""
    if dims != KERNEL_DIMS:
        return f"MLA dims (rank, rope, nope, v) {dims} are not DeepSeek's {KERNEL_DIMS}"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (its MLA kernels take bfloat16/float16)"
    return None
