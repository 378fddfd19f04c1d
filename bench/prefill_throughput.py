"""Prefill throughput: our runner against ``transformers`` on the same random checkpoint.

One row per model family (``FAMILIES``): a dense Llama of realistic proportions (hidden
1024, 8 layers, GQA 16/4, vocab 32k), a Qwen3-MoE (64 experts, top 8), a DeepSeek-V3 (MLA
attention, grouped sigmoid routing, a shared expert), a DeepSeek-V3.2 (the same plus a DSA
indexer per layer choosing each query's top 512 keys; its row's ``kv_bytes_per_token`` counts
the index keys too) and a Qwen3-Next (gated DeltaNet in 6
of its 8 layers, both sides running the same torch delta rule; its FLOP count treats every
layer as attention, so its MFU is indicative only) and a gpt-oss (sliding window 128 on every
other layer, sinks, 64 experts, top 8; its FLOP count ignores the window). For each,
in one process, same weights, dtype and threads, it times a mixed batch of 8 prompts (64 to
2048 tokens): ours as one packed plan; HF one prompt at a time and as one padded batch (the
faster is the baseline; HF's MoE experts run its default ``experts_implementation``). Also
measures the GEMM peak of this run and our MFU on the 2048-token prompt (active parameters
only: a MoE token pays for its top-k experts). Runs are interleaved and the best of each
kept, because other processes share the cores: only ratios within one run mean anything.

Prints one JSON line per family and dtype::

    {"name": "prefill_throughput", "family": ..., "dtype": ..., "ours_tok_s": ...,
     "hf_tok_s": ..., "ratio": ..., "gemm_peak_gflops": ..., "mfu": ...,
     "kv_bytes_per_token": ...}

``--quant fp8`` benches FP8 checkpoints instead (the rows say ``"quant": "fp8"``): the random
checkpoint's linear layers quantized block-wise (128 × 128, float8_e4m3fn with
``weight_scale_inv``, as DeepSeek ships them; ``tests/fp8_checkpoints.py``), ours loading that,
``transformers`` the same weights dequantized (the worker dequantizes at load, so the forward's
cost is the unquantized one; the row shows it). ``bench/results/fp8.jsonl`` holds a run of
``--quick --family llama --family deepseek_v3 --dtype bfloat16 --repeats 2`` with and without
``--quant fp8`` (2 shared cores under a mutation run: tok/s moved 2-3x between runs; only
that the FP8 checkpoints load and run is the result), then ``bench/transfer_bandwidth.py``'s
``--kv-dtypes bfloat16,fp8_e4m3`` rows.

``--family`` picks families (default: every one this build serves; a family whose
architecture is not in ``hf_config.ARCHITECTURES`` is skipped with a note); ``--quick``
shrinks the models and prompts for a smoke run; ``--profile`` prints a torch.profiler table
of one forward of ours. Recorded rows:
``bench/results/prefill_throughput.jsonl`` (``--repeats 1``, 2 shared CPU cores; recorded
before ``kv_bytes_per_token`` was added, except deepseek_v3's: its 8 layers x (256 + 32)
latent values are 9216 bytes per token in fp32, the MLA arithmetic exactly). The
qwen3_next rows name their command, tree and load: at full size fp32 1.55x and bf16 0.91x,
``--quick`` fp32 1.62x and bf16 0.88x (bf16 below the 1.2x goal; not profiled: both sides run
the same torch delta rule, so the linear layers leave less to win than attention does). The
deepseek_v32 rows (``--quick --repeats 2``, 2 shared cores under load 11-17): fp32 0.87x and
bf16 1.88x scoring every query against every key of its chunk; fp32 2.10x and bf16 1.56x once
queries that see no more than top-k keys are not scored and each block of queries is scored
against the keys up to its last one only (the bf16 move is the load's: the change only removes
work). Full size, bf16, ``--repeats 1`` under load 15-19: 0.86x (below the goal, not profiled).
Later rows (branch hybrid-perf): gpt_oss full size bf16 2.38x; qwen3_next full size bf16
1.31x on nearly idle cores and 7.51x at load 4-7 (``--repeats 2``) once the gated delta rule
runs packed over the batch's chunks with a blockwise inverse for its solves (3x less CPU
time per DeltaNet layer on one 2048-token prompt, profiled; transformers' rule spends half
its time in batched ``solve_triangular``, which contention slows most, so this ratio moves
with the load); deepseek_v32 full size bf16 1.81x (``--repeats 2``, load 5-7) with MLA's v
padded to k's head dim so the CPU flash kernel runs under the indexer's mask. Two
``--repeats 1`` rows (qwen3_next, deepseek_v32) were taken beside each other under CPU
pressure so high that ours' one batch run took 40-80x its 2048-token time; those rows say so
and are not ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.hf_config import ARCHITECTURES
from prefill_worker.request import SamplingParams

PAGE_SIZE = 16
PROMPTS = (64, 128, 256, 512, 768, 1024, 1536, 2048)
QUICK_PROMPTS = (32, 64, 128, 256, 384, 512, 768, 1024)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMMON = dict(vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


@dataclass(frozen=True)
class Family:
    """A model family to bench: its HF config class and its full and quick shapes."""

    name: str  # the "family" key of the JSON line
    architecture: str  # served when it is a key of hf_config.ARCHITECTURES
    config_class: str  # a transformers config class
    full: dict[str, object]
    quick: dict[str, object]

    def config(self, quick: bool) -> PretrainedConfig:
        fields = {**COMMON, **(self.quick if quick else self.full)}
        return getattr(transformers, self.config_class)(**fields)

    @property
    def is_served(self) -> bool:
        return self.architecture in ARCHITECTURES


DENSE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8)
DENSE_QUICK = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4)
ATTENTION = dict(num_attention_heads=16, num_key_value_heads=4)
ATTENTION_QUICK = dict(num_attention_heads=8, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=8, moe_intermediate_size=256)
MOE_QUICK = dict(num_experts_per_tok=4, moe_intermediate_size=128)
LINEAR = dict(
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
    linear_value_head_dim=64, norm_topk_prob=True,
)  # fmt: skip
LINEAR_QUICK = LINEAR | dict(linear_num_key_heads=4, linear_num_value_heads=8)
FAMILIES = (
    Family(
        "llama", "LlamaForCausalLM", "LlamaConfig", DENSE | ATTENTION, DENSE_QUICK | ATTENTION_QUICK
    ),
    Family(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        DENSE | ATTENTION | MOE | dict(num_experts=64, head_dim=64, norm_topk_prob=True),
        DENSE_QUICK
        | ATTENTION_QUICK
        | MOE_QUICK
        | dict(num_experts=32, head_dim=64, norm_topk_prob=True),
    ),
    # Benched once the DeepSeek-V3 family (MLA attention) is served: until then it is skipped.
    Family(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        DENSE
        | MOE
        | dict(
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=64,
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
        ),
        DENSE_QUICK
        | MOE_QUICK
        | dict(
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
        ),
    ),
    # DeepSeek-V3.2 (DSA): DeepSeek-V3's shape plus a lightning indexer per layer choosing the
    # top 512 keys (quick: 256) of each query, so the longer prompts attend sparsely.
    Family(
        "deepseek_v32",
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        DENSE
        | MOE
        | dict(
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=64,
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
            index_topk=512,
            index_n_heads=16,
            index_head_dim=64,
        ),
        DENSE_QUICK
        | MOE_QUICK
        | dict(
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            index_topk=256,
            index_n_heads=8,
            index_head_dim=64,
        ),
    ),
    # The hybrid: gated DeltaNet in 3 of 4 layers (its state in per-request slots), gated
    # full attention in the 4th, Qwen3-Next's MoE with a gated shared expert.
    Family(
        "qwen3_next",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        DENSE
        | ATTENTION
        | MOE
        | LINEAR
        | dict(num_experts=64, head_dim=64, shared_expert_intermediate_size=512),
        DENSE_QUICK
        | ATTENTION_QUICK
        | MOE_QUICK
        | LINEAR_QUICK
        | dict(num_experts=32, head_dim=64, shared_expert_intermediate_size=256),
    ),
    # gpt-oss: sliding (window 128) and full layers alternating, sinks, biased router, clamped
    # SwiGLU experts (unquantized here: both sides run the same bf16/fp32 weights).
    Family(
        "gpt_oss",
        "GptOssForCausalLM",
        "GptOssConfig",
        DENSE
        | ATTENTION
        | dict(intermediate_size=256, num_local_experts=64, num_experts_per_tok=8, head_dim=64),
        DENSE_QUICK
        | ATTENTION_QUICK
        | dict(intermediate_size=128, num_local_experts=32, num_experts_per_tok=4, head_dim=64),
    ),
)


def make_checkpoint(config: PretrainedConfig, path: Path) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def best_time(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def layer_gemms(model: torch.nn.Module) -> list[tuple[str, tuple[int, int], float]]:
    """Each weight of the first and last layers as ``(name, (n, k), active)``: a 3-D stack of
    experts ``[E, n, k]`` is one expert's GEMM, active for ``top_k / E`` of the tokens."""
    config, gemms = model.config, []
    last = config.num_hidden_layers - 1
    for name, param in model.named_parameters():
        if not name.startswith(("model.layers.0.", f"model.layers.{last}.")) or param.ndim < 2:
            continue
        if param.ndim == 3:
            gemms.append((name, tuple(param.shape[1:]), config.num_experts_per_tok))
        elif ".experts." in name:  # one expert's own matrix (per-expert checkpoints)
            gemms.append((name, tuple(param.shape), config.num_experts_per_tok / _experts(config)))
        else:
            gemms.append((name, tuple(param.shape), 1.0))
    return gemms  # type: ignore[return-value]


def _experts(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_experts", None) or config.n_routed_experts)


def gemm_peak_gflops(model: torch.nn.Module, dtype: torch.dtype, m: int) -> float:
    """Best GFLOP/s of ``F.linear`` over the model's own GEMM shapes at ``m`` rows."""
    best = 0.0
    for n, k in sorted({shape for _, shape, _ in layer_gemms(model)}):
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        F.linear(x, w)
        seconds = best_time(lambda x=x, w=w: F.linear(x, w), repeats=4)
        best = max(best, 2 * m * n * k / seconds / 1e9)
    return best


def prefill_flops(model: torch.nn.Module, length: int) -> float:
    """The active linear layers over every token (the mean of the first and last layers' per
    layer), causal attention (QK and PV, per head), one LM-head row."""
    config = model.config
    per_token = sum(n * k * active for _, (n, k), active in layer_gemms(model)) / 2
    linear = 2 * config.num_hidden_layers * per_token * length
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qk_dim = getattr(config, "qk_head_dim", None) or head_dim
    v_dim = getattr(config, "v_head_dim", None) or head_dim
    pairs = length * (length + 1) / 2
    attention = 2 * config.num_hidden_layers * config.num_attention_heads * (qk_dim + v_dim) * pairs
    return linear + attention + 2 * config.hidden_size * config.vocab_size


def plan_of(prompts: list[list[int]]) -> BatchPlan:
    chunks, next_page = [], 0
    for i, ids in enumerate(prompts):
        count = -(-len(ids) // PAGE_SIZE)
        pages = list(range(next_page, next_page + count))
        next_page += count
        chunk = ChunkPlan(f"r{i}", ids, 0, len(ids), pages, SamplingParams(), state_slot=i)
        chunks.append(chunk)  # (a hybrid model's state slot; the others ignore it)
    return BatchPlan(0, tuple(chunks))


def hf_one_by_one(model: torch.nn.Module, prompts: list[list[int]]) -> None:
    with torch.inference_mode():
        for ids in prompts:
            model(torch.tensor([ids]))


def hf_padded(model: torch.nn.Module, prompts: list[list[int]]) -> None:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding, as for generation
        ids[row, longest - len(p) :] = torch.tensor(p)
        mask[row, longest - len(p) :] = 1
    with torch.inference_mode():
        model(ids, attention_mask=mask)


def measure(
    family: str, path: Path, sizes: tuple[int, ...], dtype: str, repeats: int,
    hf_path: Path | None = None, quant: str = "none",
) -> dict[str, object]:  # fmt: skip
    """``hf_path``: the checkpoint ``transformers`` loads, when not ``path`` (FP8's reference)."""
    hf = AutoModelForCausalLM.from_pretrained(hf_path or path, dtype=DTYPES[dtype]).eval()
    gen = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in sizes]
    total = sum(sizes)
    runner, kv_cache, _ = build(
        path, dtype, "cpu", "sdpa", PAGE_SIZE, num_pages=total // PAGE_SIZE + 16
    )
    pool = kv_cache.layout  # bytes per token: for MLA, check-config's latent arithmetic
    kv_bytes_per_token = pool.pool_bytes // (pool.num_pages * pool.page_size)
    index_cache = getattr(runner.model, "index_cache", None)  # DSA: its index keys, beside
    if index_cache is not None:
        kv_bytes_per_token += index_cache.num_bytes // (pool.num_pages * pool.page_size)
    batch = plan_of(prompts)
    runner.run(plan_of(prompts[:2]))  # warm-up
    hf_one_by_one(hf, prompts[:2])
    ours_s = seq_s = float("inf")
    for _ in range(repeats):  # interleaved, so a noisy neighbour hurts both sides alike
        ours_s = min(ours_s, best_time(lambda: runner.run(batch), 1))
        seq_s = min(seq_s, best_time(lambda: hf_one_by_one(hf, prompts), 1))
    padded_s = best_time(lambda: hf_padded(hf, prompts), 1)
    longest = plan_of([prompts[-1]])
    # The peak is the best seen, so it is measured around the runs it is compared with.
    peak = gemm_peak_gflops(hf, DTYPES[dtype], m=max(sizes))
    single_s = best_time(lambda: runner.run(longest), max(3, repeats))  # short: more tries
    peak = max(peak, gemm_peak_gflops(hf, DTYPES[dtype], m=max(sizes)))
    hf_s = min(seq_s, padded_s)
    print(
        f"# {family} {dtype}: ours {ours_s:.2f}s, HF one-by-one {seq_s:.2f}s, HF padded "
        f"{padded_s:.2f}s, ours on {sizes[-1]} tokens {single_s:.2f}s (HF experts: "
        f"{getattr(hf.config, '_experts_implementation', None)})",
        file=sys.stderr,
    )
    return {
        "name": "prefill_throughput",
        "family": family,
        "dtype": dtype,
        "quant": quant,
        "ours_tok_s": round(total / ours_s, 1),
        "hf_tok_s": round(total / hf_s, 1),
        "ratio": round(hf_s / ours_s, 3),
        "gemm_peak_gflops": round(peak, 1),
        "mfu": round(prefill_flops(hf, sizes[-1]) / single_s / 1e9 / peak, 3),
        "kv_bytes_per_token": kv_bytes_per_token,
    }


def fp8_checkpoint(source: Path, root: Path) -> tuple[Path, Path]:
    """(``source`` quantized as DeepSeek ships FP8, its dequantized reference): the tests'
    quantizer, from the repository root."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fp8_checkpoints import quantize_checkpoint

    return quantize_checkpoint(source, root)


def profile(path: Path, sizes: tuple[int, ...], dtype: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner, _, _ = build(
        path, dtype, "cpu", "sdpa", PAGE_SIZE, num_pages=sum(sizes) // PAGE_SIZE + 16
    )
    gen = torch.Generator().manual_seed(1)
    vocab = runner.model.spec.vocab_size
    plan = plan_of([torch.randint(0, vocab, (n,), generator=gen).tolist() for n in sizes])
    runner.run(plan)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.run(plan)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and prompts")
    parser.add_argument("--family", choices=[f.name for f in FAMILIES], action="append")
    parser.add_argument("--dtype", choices=[*DTYPES, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant", choices=["none", "fp8"], default="none")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--profile", action="store_true", help="profile ours instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK_PROMPTS if args.quick else PROMPTS
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    for family in FAMILIES:
        if args.family and family.name not in args.family:
            continue
        if not family.is_served:
            print(
                f"# {family.name}: {family.architecture} is not served here: skipped",
                file=sys.stderr,
            )
            continue
        with tempfile.TemporaryDirectory(prefix="prefill-bench-") as tmp:
            path, hf_path = Path(tmp) / "source", None
            make_checkpoint(family.config(args.quick), path)
            if args.quant == "fp8":
                path, hf_path = fp8_checkpoint(path, Path(tmp))
            for dtype in dtypes:
                if args.profile:
                    profile(path, sizes, dtype)
                    continue
                row = measure(family.name, path, sizes, dtype, args.repeats, hf_path, args.quant)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
