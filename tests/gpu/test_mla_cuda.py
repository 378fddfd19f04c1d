"""MLA on CUDA (skipped without one): flashinfer's MLA backend against the torch path, then
the whole DeepSeek-V3 tiny model against transformers.

DeepSeek's MLA dims (kv_lora_rank 512, rope 64, nope 128, v 128: the only shape the
registry gives flashinfer) on a tiny model. flashinfer's MLA kernels take bf16/fp16 only, so
they run in bf16 and are held to at most twice the torch path's own bf16 error (+ 0.01)
against an fp32 reference: the torch path in fp32, or transformers in fp32 on the CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.attention import AttentionBatch, create_mla_backend
from prefill_worker.model.attention.flashinfer_mla import FlashInferMLABackend
from prefill_worker.model.hf_config import MLASpec
from prefill_worker.request import SamplingParams
from tests.attention_batches import scattered_batch
from tests.checkpoints import hf_model, make_checkpoint, prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed"
    ),
]

DIMS = dict(  # transformers derives qk_head_dim and head_dim in __init__: set them too
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    qk_head_dim=192, head_dim=64,
)  # fmt: skip
SPEC = MLASpec(None, 512, 128, 64, 128, True, softmax_scale=0.135)  # ~YaRN's at factor 40
PAGE_SIZE, NUM_PAGES, HEADS = 16, 64, 16  # 16 heads: DeepSeek-V3's 128 under TP 8
# the reference, the torch path at the kernels' precision, the kernels
RUNS = (("sdpa", torch.float32), ("sdpa", torch.bfloat16), ("flashinfer", torch.bfloat16))


def _batch(chunks: list[tuple[int, int]]) -> tuple[AttentionBatch, torch.Tensor]:
    return scattered_batch(chunks, PAGE_SIZE, NUM_PAGES)


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 100), (0, 37)],  # fresh prompts: the ragged, decompressed form
        [(128, 200), (0, 100), (40, 41), (16, 64)],  # a prefix in the batch: paged, absorbed
    ],
    ids=["ragged", "paged"],
)
def test_flashinfer_mla_matches_the_torch_path(chunks):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    batch, slots = _batch(chunks)
    width = SPEC.kv_lora_rank + SPEC.qk_rope_head_dim
    pool = torch.randn(2, NUM_PAGES, PAGE_SIZE, 1, width, generator=gen, device=device)[1]
    q = torch.randn(batch.num_tokens, HEADS, SPEC.qk_head_dim, generator=gen, device=device)
    kv_b = torch.randn(HEADS * 256, SPEC.kv_lora_rank, generator=gen, device=device) / 16
    rows = pool.view(-1, width)[slots.to(device)]  # this batch's rows, already in the pool
    outputs = {}
    for name, dtype in RUNS:
        backend = create_mla_backend(name, device, SPEC, dtype)
        assert isinstance(backend, FlashInferMLABackend) == (name == "flashinfer")
        backend.plan(batch)
        out = torch.empty(batch.num_tokens, HEADS, SPEC.v_head_dim, device=device, dtype=dtype)
        q_, rows_, pool_, kv_b_ = (t.to(dtype) for t in (q * 3, rows, pool, kv_b))
        backend.attend_latent(q_, rows_, pool_, kv_b_, SPEC, out)
        outputs[name, dtype] = out.float()
    errors = {run: float((outputs[run] - outputs[RUNS[0]]).abs().max()) for run in RUNS[1:]}
    assert errors[RUNS[2]] <= 2 * errors[RUNS[1]] + 1e-2, errors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mla-cuda") / "ckpt", **DIMS)


def _schedule(runner) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Fresh prompts (ragged), the rest of one of them (paged), a prefix hit (paged): the
    last-token logits of ``other``, ``a`` and ``b``."""
    a, other = prompt(150, seed=5), prompt(37, seed=6)
    b = a[:64] + prompt(30, seed=7)
    pages_a, pages_o = list(range(40, 30, -1)), [50, 48, 46]
    pages_b = [*pages_a[:4], 60, 58, 56]
    first = runner.compute_logits(
        BatchPlan(0, (ChunkPlan("o", other, 0, 37, pages_o, SamplingParams()),
                      ChunkPlan("a", a[:64], 0, 64, pages_a, None)))
    )  # fmt: skip
    rest = runner.compute_logits(
        BatchPlan(1, (ChunkPlan("a", a[64:], 64, 150, pages_a, SamplingParams()),))
    )
    hit = runner.compute_logits(
        BatchPlan(2, (ChunkPlan("b", b[64:], 64, 94, pages_b, SamplingParams()),))
    )
    return [first[0].float().cpu(), rest[0].float().cpu(), hit[0].float().cpu()]


def test_deepseek_v3_on_cuda_against_transformers(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_model(checkpoint)
    a, other = prompt(150, seed=5), prompt(37, seed=6)
    b = a[:64] + prompt(30, seed=7)
    with torch.no_grad():
        expected = [hf(torch.tensor([ids])).logits[0, -1].float() for ids in (other, a, b)]
    errors = {}
    for name, dtype in (("sdpa", "float32"), ("sdpa", "bfloat16"), ("flashinfer", "bfloat16")):
        runner, _, info = build(checkpoint, dtype, "cuda", name, PAGE_SIZE, num_pages=64)
        assert info.attention_backend == name
        got = _schedule(runner)
        errors[name, dtype] = max(
            float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)
        )
        del runner
    assert errors["sdpa", "float32"] < 2e-3, errors  # the torch path on CUDA, fp32
    assert errors["flashinfer", "bfloat16"] <= 2 * errors["sdpa", "bfloat16"] + 1e-2, errors
