"""The expert-parallel exchanges on CUDA (NCCL), 2 rank processes on cuda:0 and cuda:1
(skipped with fewer devices): ``torch`` (all-to-all) and ``deepep`` (DeepEP's normal kernels;
skipped where ``deep_ep`` does not import). Each rank brings its own tokens (different counts),
bf16, and gets each token's routed experts' weighted sum, computed by their owners (contiguous:
DeepEP's only placement), within bf16 tolerance of one device holding every expert.
Not run where this was written (a CPU host): its result is for the first GPU host to say."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
import torch

from prefill_worker.model.moe import create_moe_backend
from prefill_worker.model.moe.ep import EP_EXCHANGES, EPGroup
from prefill_worker.model.moe.placement import contiguous
from prefill_worker.testing.launch import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = (64, 37), 256, 128, 8, 2


def _rank(rank: int, port: int, exchange_name: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=device) / 16
        down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=device) / 16
        gen.manual_seed(1 + rank)
        x = torch.randn(TOKENS[rank], HIDDEN, generator=gen, device=device)
        scores = torch.rand(TOKENS[rank], EXPERTS, generator=gen, device=device)
        weights, ids = scores.topk(TOP_K, dim=1)
        placement = contiguous(EXPERTS, 2)
        mine = list(placement.local_experts(rank))
        grouped = create_moe_backend("grouped", device)
        half = [t.bfloat16() for t in (gate_up[mine], down[mine])]

        def local(rows, w, local_ids):  # type: ignore[no-untyped-def]
            return grouped.experts(rows, w, local_ids, *half)

        exchange = EP_EXCHANGES[exchange_name](EPGroup(rank, placement), device)
        got = exchange.dispatch_combine(x.bfloat16(), weights.bfloat16(), ids, local)
        want = grouped.experts(x, weights, ids, gate_up, down)
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("exchange_name", ["torch", "deepep"])
def test_exchange_matches_one_device_holding_every_expert(exchange_name):
    if exchange_name not in EP_EXCHANGES:
        pytest.skip("deep_ep is not installed")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, exchange_name)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(300)
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
