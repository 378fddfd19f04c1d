"""A DSA model served to SGLang decodes: its index keys kept in SGLang's FP8 pages as well
(``model.index_fp8``), written by every forward from start-up on, whose regions the SGLang
backend sends with each KV page (``transfer.sglang.dsa``)."""

from __future__ import annotations

import logging

from prefill_worker.batch import ModelRunner
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.model import Runner
from prefill_worker.model.dsa import DeepseekV32LM
from prefill_worker.model.index_fp8 import can_hold
from prefill_worker.service.config import Config
from prefill_worker.tp.leader import local_runner

log = logging.getLogger(__name__)


def attach_sglang_index(config: Config, runner: ModelRunner, device: str) -> StateRegions | None:
    """The FP8 index pages' regions (``device`` as the KV pool names it) when SGLang decodes
    are served a DSA model whose index keys SGLang's pool holds (128 values); else None, and
    such a model's SGLang rooms stay refused (``transfer.state_guard``). A TP group's leader
    keeps them alone: every rank computes the same index keys (the indexer is replicated),
    and the leader's SGLang backend writes them into every decode rank."""
    runner = local_runner(runner)
    if "sglang" not in config.transfer.protocols or not isinstance(runner, Runner):
        return None
    model = runner.model
    if not isinstance(model, DeepseekV32LM) or not can_hold(model.indexer):
        return None
    pages = model.index_cache.keep_fp8()
    log.info("index pages for SGLang decodes (FP8): %d bytes beside the pool", pages.num_bytes)
    return pages.regions(device)
