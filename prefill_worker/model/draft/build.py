"""Put a configured draft model beside a loaded target (``model.build`` calls this once)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from prefill_worker.model.deepseek import DeepseekV3LM
from prefill_worker.model.draft.mtp import MTPDraft, load_mtp
from prefill_worker.model.draft.runner import DraftingRunner
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.quant.backends import Fp8WeightBackend
from prefill_worker.model.runner import Runner

log = logging.getLogger(__name__)

DRAFT_KINDS = ("none", "mtp")  # mtp: DeepSeek-V3's own NextN layer, from the target's checkpoint


def num_draft_layers(kind: str) -> int:
    """The pool layers a draft adds (the KV budget covers them)."""
    return 0 if kind == "none" else 1


def with_draft(
    model_path: str | Path,
    runner: Runner,
    kind: str,
    topk: int,
    fp8: Fp8WeightBackend | None = None,
) -> Runner:
    """``runner`` itself (``kind`` none), or a ``DraftingRunner`` over its target and the
    draft (its FP8 weights as ``fp8``, the target's backend, makes them); ``ValueError`` for
    a target the draft does not fit, ``CheckpointError`` for a checkpoint without it."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft {kind!r} is not one of {', '.join(DRAFT_KINDS)}")
    if kind == "none":
        return runner
    model = runner.model
    if not isinstance(model, DeepseekV3LM) or model.spec.indexer is not None:
        # a DSA model's MTP layer has its own indexer, which the draft does not run
        raise ValueError(f"draft 'mtp' needs a DeepSeek-V3 model, not {model.spec.architecture}")
    if not model.tp.is_single:
        raise ValueError("draft 'mtp' runs at tensor parallelism 1 only")
    device = runner.kv_cache.device
    weights = load_mtp(model_path, model.spec, model.dtype, device, model.tp, fp8)
    draft = MTPDraft(model.spec, weights, model.weights.embed, topk, model.tp, model.experts)
    draft_kv = KVCache(dataclasses.replace(runner.kv_cache.layout, num_layers=1), device)
    log.info("draft mtp: top-%d, pool %d bytes", topk, draft_kv.layout.pool_bytes)
    return DraftingRunner(model, runner.kv_cache, runner.attention, draft, draft_kv)
