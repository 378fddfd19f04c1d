"""Put a configured draft model beside a loaded target (``model.build`` calls this once)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from prefill_worker.model.deepseek import DeepseekV3LM
from prefill_worker.model.draft.eagle import EagleDraft, load_eagle, read_eagle_config
from prefill_worker.model.draft.mtp import MTPDraft, load_mtp
from prefill_worker.model.draft.runner import Draft, DraftingRunner
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.llama import CausalLM
from prefill_worker.model.quant.backends import Fp8WeightBackend
from prefill_worker.model.runner import Runner

log = logging.getLogger(__name__)

# mtp: DeepSeek-V3's own NextN layer, from the target's checkpoint; eagle, eagle3: a separate
# draft checkpoint (``draft_path``) for a Llama-family target
DRAFT_KINDS = ("none", "mtp", "eagle", "eagle3")


def num_draft_layers(kind: str) -> int:
    """The pool layers a draft adds (the KV budget covers them)."""
    return 0 if kind == "none" else 1


def with_draft(
    model_path: str | Path,
    runner: Runner,
    kind: str,
    topk: int,
    draft_path: str | Path | None = None,
    fp8: Fp8WeightBackend | None = None,
) -> Runner:
    """``runner`` itself (``kind`` none), or a ``DraftingRunner`` over its target and the
    draft (under TP, the rank's slices of the draft, split like the target's: its pool holds
    the rank's KV heads; an MTP draft's FP8 weights as ``fp8``, the target's backend, makes
    them); ``ValueError`` for a target the draft does not fit, ``CheckpointError`` for a
    checkpoint without it."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft {kind!r} is not one of {', '.join(DRAFT_KINDS)}")
    if kind == "none":
        return runner
    if kind == "mtp":
        draft = _mtp(model_path, runner, topk, fp8)
    else:
        draft = _eagle(draft_path, runner, kind, topk)
    draft_kv = KVCache(
        dataclasses.replace(runner.kv_cache.layout, num_layers=1), runner.kv_cache.device
    )
    log.info("draft %s: top-%d, pool %d bytes", kind, topk, draft_kv.layout.pool_bytes)
    return DraftingRunner(runner.model, runner.kv_cache, runner.attention, draft, draft_kv)


def _mtp(model_path: str | Path, runner: Runner, topk: int, fp8: Fp8WeightBackend | None) -> Draft:
    model = runner.model
    if not isinstance(model, DeepseekV3LM) or model.spec.indexer is not None:
        # a DSA model's MTP layer has its own indexer, which the draft does not run
        raise ValueError(f"draft 'mtp' needs a DeepSeek-V3 model, not {model.spec.architecture}")
    device = runner.kv_cache.device
    weights = load_mtp(model_path, model.spec, model.dtype, device, model.tp, fp8)
    return MTPDraft(model.spec, weights, model.weights.embed, topk, model.tp, model.experts)


def _eagle(draft_path: str | Path | None, runner: Runner, kind: str, topk: int) -> Draft:
    """An EAGLE draft whose layer's K/V fit the target's pool pages (the decode's draft pool
    is addressed with the target's page geometry)."""
    model = runner.model
    if type(model) is not CausalLM or model.spec.moe is not None:
        raise ValueError(
            f"draft {kind!r} needs a dense Llama-family model, not {model.spec.architecture}"
        )
    if draft_path is None:
        raise ValueError(f"draft {kind!r} needs the draft checkpoint's path (model.draft_path)")
    config = read_eagle_config(draft_path, kind, model.spec)
    target = model.spec
    if (config.spec.num_kv_heads, config.spec.head_dim) != (target.num_kv_heads, target.head_dim):
        raise ValueError(
            f"the draft's K/V ({config.spec.num_kv_heads} heads of {config.spec.head_dim}) "
            f"are not the target's ({target.num_kv_heads} of {target.head_dim})"
        )
    weights = load_eagle(draft_path, config, model, runner.kv_cache.device)
    return EagleDraft(config, weights, model, topk)
