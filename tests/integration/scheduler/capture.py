"""Test seams for the engine with the real runner: a sender that copies each page's K/V at
the moment it is handed over (what NIXL would read then), and a runner that keeps the plans."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefill_worker.batch import BatchOutput, BatchPlan, ModelRunner
from prefill_worker.model import KVCache
from tests.unit.scheduler.fakes import FakeBackend, FakeSender


class CapturingSender(FakeSender):
    """Copies K and V ``[layers, page_size, KV, D]`` of each page as it is handed over (an
    MLA pool: its latent rows ``[layers, page_size, 1, r + rope]`` as K, and an empty V)."""

    kv_cache: KVCache
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        super().send_pages(page_ids, first_page, sliding_page_ids)
        for i, page_id in enumerate(page_ids):
            k = torch.stack([layer[page_id] for layer in self.kv_cache.k]).clone()
            v = (
                torch.stack([layer[page_id] for layer in self.kv_cache.v])
                if self.kv_cache.v
                else k[:0]
            )
            v = v.clone()
            self.captured[first_page + i] = (k, v)


class RecordingRunner:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.plans: list[BatchPlan] = []

    def run(self, plan: BatchPlan) -> BatchOutput:
        self.plans.append(plan)
        return self.runner.run(plan)


class CapturingBackend(FakeBackend):
    kv_cache: KVCache

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> FakeSender:
        sender = CapturingSender(self, room, request_id, num_prompt_tokens)
        sender.kv_cache, sender.captured = self.kv_cache, {}
        self.senders[request_id] = sender
        self.all_senders.append(sender)
        return sender
