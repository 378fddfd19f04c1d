"""Runs tensor-parallel groups of real processes (gloo on CPU, 127.0.0.1) over the runner.

``run_world`` starts one world of ranks, once, for every TP size a test asks for: the world
has the largest size's ranks, and each smaller size runs on consecutive sub-groups of it
(``torch.distributed.new_group``; TP 2 in a world of 4: ranks {0, 1} and {2, 3}), its
cases dealt round-robin over them, so the sub-groups work side by side. Each group builds a
case's checkpoint at its ranks and runs the same three batches::

    batch 0   long [0, 32) on pages 15, 11     beside  short, whole, on pages 13, 9
    batch 1   long [32, end) on page 7         beside  hit [32, end): a prefix-cache hit
              (reads 15, 11 back)                      (reads long's pages 15, 11, writes 5)

``hit`` shares long's first 32 tokens (two whole pages), so its chunk starts at 32 with
those pages in front of its own, as the scheduler plans a hit: its logits and K/V are
right only if the runner reads the prefix back from the pool. Each rank saves the three
prompts' logits and its pool's K/V (a DSA model: its index keys too). Every join has a
deadline; a rank left alive past it is killed, so a stuck collective fails the test instead
of hanging it.

A case built with a windowed sliding pool (``sliding_pages`` among its extra arguments) has no
prefix hits either: long in two chunks beside short, each rank planning the same sliding
entries (``kv.sliding``), long's early sliding pages freed after its first chunk; its sliding
layers' K/V is read back through the entries (unheld pages as zeros).

A hybrid checkpoint (a state pool: Qwen3-Next, Qwen3.5) has no prefix hits, so its batch 1
is long's rest alone; each request holds its own state slot (``SLOTS``), and each rank also
saves every linear layer's conv window and recurrent state of long and short from its slots
(the leader: also the whole slots it gathered, ``model.state_gather``).

Ranks come from a forkserver that has imported torch and the model once (a fresh interpreter
per rank costs seconds on a loaded machine; forking the test process itself is unsafe once it
has run OpenMP). This module imports nothing of transformers, for the same reason.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import NO_PAGE, SlidingPageTable
from prefill_worker.kv.state_layout import LINEAR_STATE
from prefill_worker.model import TPGroup, build
from prefill_worker.model.quant.backends import BlockGemm
from prefill_worker.model.quant.block_gemm import Fp8BlockWeight
from prefill_worker.request import SamplingParams
from prefill_worker.testing.launch import free_port

SPLIT = 32  # long is prefilled in two chunks, [0, 32) and the rest; hit shares [0, 32)
PAGE_SIZE, NUM_PAGES = 16, 16
PAGES = {"long": [15, 11, 7], "short": [13, 9], "hit": [15, 11, 5]}  # scattered, descending
DEADLINE_S = 180.0
SLOTS = {"long": 0, "short": 1, "hit": 2}


@dataclass(frozen=True, slots=True)
class Prompts:
    long: list[int]
    short: list[int]
    hit: list[int]  # long[:SPLIT] + its own suffix

    def __post_init__(self) -> None:
        assert self.hit[:SPLIT] == self.long[:SPLIT] and SPLIT % PAGE_SIZE == 0


def result_path(out_dir: Path, name: str, size: int, rank: int) -> Path:
    """Where rank ``rank`` (in its TP ``size`` group) saves case ``name``'s results."""
    return out_dir / f"{name}.tp{size}.{rank}.pt"


Case = Path | tuple[Path, dict[str, object]]  # a checkpoint, or one with build()'s extra args
GEMM_SUFFIX = "+block_gemm"  # a case so named loads its FP8 with ``block_gemm_on_cpu``


def block_gemm_on_cpu(calls: list[int]) -> BlockGemm:
    """The registry's CUDA path (FP8 kept as shipped, ``quant.backends.BlockGemm``) with the
    kernel swapped for the dequantized linear (each call's N appended to ``calls``): the
    wiring at TP > 1 on a CPU."""

    def kernel(x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
        calls.append(w.shape[0])
        return F.linear(x, w.dequantized(x.dtype))

    return BlockGemm(kernel)


def run_world(
    cases: Mapping[int, Mapping[str, Case]],
    prompts: Prompts,
    out_dir: Path,
    then: Callable[[int, int, Path], None] | None = None,
) -> None:
    """Run ``cases[size][name]`` (a checkpoint, with extra ``build`` arguments where a pair,
    e.g. ``ep_size``; a name ending in ``GEMM_SUFFIX``: on the block-GEMM path,
    ``block_gemm_on_cpu``) at each TP size in one world of ranks; then ``then(rank, world,
    out_dir)`` on every rank, in the world group (a module-level function: it crosses the
    forkserver)."""
    world = max(cases)
    assert all(world % size == 0 for size in cases)
    args = (world, free_port(), dict(cases), prompts, out_dir, then)
    spawn_ranks(_rank_main, world, args, __name__)


def spawn_ranks(
    target: Callable[..., None], world: int, args: tuple[object, ...], module: str,
    deadline_s: float = DEADLINE_S,
) -> None:  # fmt: skip
    """``target(rank, *args)`` in ``world`` processes from a forkserver that imported
    ``module`` (``target``'s, so that no rank imports transformers); each must exit 0 within
    ``deadline_s`` (one left running is killed)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "prefill_worker.model", module])
    ranks = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + deadline_s
    try:
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(10)
    codes = [process.exitcode for process in ranks]
    assert codes == [0] * world, f"rank exit codes {codes} (None: killed at the deadline)"


def _rank_main(
    rank: int,
    world: int,
    port: int,
    cases: dict[int, dict[str, Case]],
    prompts: Prompts,
    out_dir: Path,
    then: Callable[[int, int, Path], None] | None,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets on the loopback too
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        for size in sorted(cases):
            tp, index = _my_group(rank, world, size)
            for name in sorted(cases[size])[index :: world // size]:
                saved = _run_case(cases[size][name], tp, prompts, name.endswith(GEMM_SUFFIX))
                torch.save(saved, result_path(out_dir, name, size, tp.rank))
        if then is not None:
            then(rank, world, out_dir)
    finally:
        dist.destroy_process_group()


def _my_group(rank: int, world: int, size: int) -> tuple[TPGroup, int]:
    """This rank's TP ``size`` group (every rank creates every sub-group, in one order, as
    ``new_group`` requires) and the group's index among them."""
    if size == world:
        return TPGroup(rank, size, torch.distributed.group.WORLD), 0
    mine = None
    for first in range(0, world, size):
        group = torch.distributed.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = TPGroup(rank - first, size, group), first // size
    assert mine is not None
    return mine


def _run_case(case: Case, tp: TPGroup, prompts: Prompts, gemm: bool) -> dict[str, object]:
    path, extra = case if isinstance(case, tuple) else (case, {})
    calls: list[int] = []  # the block GEMM's calls (gemm: every FP8 projection's)
    fp8 = block_gemm_on_cpu(calls) if gemm else None
    runner, kv_cache, info = build(
        path, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES, tp=tp,
        fp8_backend=fp8, **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    if info.state is not None and info.state.kind == LINEAR_STATE:
        return _run_hybrid_case(runner, kv_cache, info, prompts)
    if kv_cache.sliding is not None:
        return _run_windowed_case(runner, kv_cache, info, prompts)
    long, short, hit = prompts.long, prompts.short, prompts.hit
    first = runner.compute_logits(
        BatchPlan(0, (_chunk("long", long, 0, SPLIT), _chunk("short", short, 0, len(short))))
    )
    second = runner.compute_logits(
        BatchPlan(1, (_chunk("long", long, SPLIT, len(long)), _chunk("hit", hit, SPLIT, len(hit))))
    )
    layers = range(info.num_layers)
    lengths = {"long": len(long), "short": len(short), "hit": len(hit)}
    saved: dict[str, object] = {
        "short_logits": first[0].clone(),
        "long_logits": second[0].clone(),
        "hit_logits": second[1].clone(),
        "gemm_calls": len(calls),
    }
    index_cache = getattr(runner.model, "index_cache", None)  # a DSA model's index keys
    for key, length in lengths.items():
        saved[f"{key}_kv"] = [_paged_kv(kv_cache, PAGES[key], length, i) for i in layers]
        if index_cache is not None:
            indexed = index_cache.spec.indexed_layers
            saved[f"{key}_index"] = {i: index_cache.read(i, PAGES[key], length) for i in indexed}
    return saved


def _run_hybrid_case(runner, kv_cache, info, prompts: Prompts) -> dict[str, object]:  # type: ignore[no-untyped-def]
    long, short = prompts.long, prompts.short
    whole = runner.model.gather.whole  # the leader's gathered slots; None on a follower
    first = runner.compute_logits(
        BatchPlan(0, (_chunk("long", long, 0, SPLIT), _chunk("short", short, 0, len(short))))
    )
    saved: dict[str, object] = {"short_logits": first[0].clone()}
    if whole is not None:  # long's first chunk does not end its prompt: nothing gathered yet
        saved["long_whole_after_first"] = any(t[SLOTS["long"]].any() for t in whole.conv)
        saved["state_shapes"] = [t.item_shape for t in info.state.tensors]  # what it describes
    second = runner.compute_logits(BatchPlan(1, (_chunk("long", long, SPLIT, len(long)),)))
    saved["long_logits"] = second[0].clone()
    state = runner.model.state
    for key, ids in (("long", long), ("short", short)):
        layers = range(kv_cache.layout.num_layers)
        saved[f"{key}_kv"] = [_paged_kv(kv_cache, PAGES[key], len(ids), i) for i in layers]
        saved[f"{key}_conv"] = [conv[SLOTS[key]].clone() for conv in state.conv]
        saved[f"{key}_recurrent"] = [rec[SLOTS[key]].clone() for rec in state.recurrent]
        if whole is not None:
            saved[f"{key}_whole"] = [
                (conv[SLOTS[key]].clone(), rec[SLOTS[key]].clone())
                for conv, rec in zip(whole.conv, whole.recurrent, strict=True)
            ]
    return saved


def _run_windowed_case(runner, kv_cache, info, prompts: Prompts) -> dict[str, object]:  # type: ignore[no-untyped-def]
    window = info.sliding_window
    table = SlidingPageTable(PagePool(kv_cache.sliding.num_pages), PAGE_SIZE, window, SPLIT)
    long, short = prompts.long, prompts.short
    assert table.try_reserve("long", len(long)) and table.try_reserve("short", len(short))

    def chunk(request_id: str, ids: list[int], start: int, end: int) -> ChunkPlan:
        entries = table.pages_for(request_id, start, end)
        return dataclasses.replace(_chunk(request_id, ids, start, end), sliding_page_ids=entries)

    batch0 = (chunk("long", long, 0, SPLIT), chunk("short", short, 0, len(short)))
    first = runner.compute_logits(BatchPlan(0, batch0))
    later = chunk("long", long, SPLIT, len(long))  # planned before batch 0 is trimmed
    table.chunk_done("long", SPLIT)
    table.chunk_done("short", len(short))
    second = runner.compute_logits(BatchPlan(1, (later,)))
    table.chunk_done("long", len(long))
    saved: dict[str, object] = {"short_logits": first[0].clone(), "long_logits": second[0].clone()}
    for key, ids in (("long", long), ("short", short)):
        saved[f"{key}_kv"] = [
            _paged_kv(kv_cache, list(table.get(key)), len(ids), i)
            if i in info.sliding_layers
            else _paged_kv(kv_cache, PAGES[key], len(ids), i)
            for i in range(info.num_layers)
        ]
    saved["sliding_pages_held"] = table.pool.num_used
    return saved


def _chunk(request_id: str, ids: list[int], start: int, end: int) -> ChunkPlan:
    sampling = SamplingParams() if end == len(ids) else None
    slot = SLOTS[request_id]  # a model without a state pool ignores it
    pages = PAGES[request_id]
    return ChunkPlan(request_id, ids[start:end], start, end, pages, sampling, state_slot=slot)


def _paged_kv(kv_cache, pages: list[int], length: int, layer: int):  # type: ignore[no-untyped-def]
    """This rank's K and V of positions [0, length): ``[length, local KV, D]`` each (an MLA
    pool: its latent rows alone, ``[length, 1, r + rope]``; a page ``NO_PAGE``: zeros)."""
    k = torch.cat([_page(kv_cache.k[layer], p) for p in pages])[:length]
    if not kv_cache.v:
        return (k.clone(),)
    v = torch.cat([_page(kv_cache.v[layer], p) for p in pages])[:length]
    return k.clone(), v.clone()


def _page(plane: torch.Tensor, page_id: int) -> torch.Tensor:
    return torch.zeros_like(plane[0]) if page_id == NO_PAGE else plane[page_id]
