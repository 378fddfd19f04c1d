"""The warm-up forward through a real runner (sdpa, a random Llama): it runs, the pool is whole,
and the pages it used hold K/V (the forward wrote them)."""

from __future__ import annotations

import torch

from prefill_worker.kv.pages import PagePool
from prefill_worker.scheduler.warmup import warm_up
from prefill_worker.testing.random_model import random_runner


def test_a_real_runner_warms_up() -> None:
    config = dict(
        architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    runner, _ = random_runner(config, torch.float32, torch.device("cpu"), "sdpa", 16, 8)
    pages = PagePool(8)
    done = warm_up(runner, pages, page_size=16, num_tokens=40, vocab_size=300, chunk_tokens=32)
    assert done.num_tokens == 40 and pages.num_free == pages.num_pages
    k = runner.kv_cache.k[1]  # [pages, page_size, kv_heads, head_dim], zeros until written
    written = (k.abs().sum(dim=(1, 2, 3)) > 0).tolist()
    assert written == [True, True, True, False, False, False, False, False]  # 40 tokens
