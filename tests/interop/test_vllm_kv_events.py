"""Our KV events are vLLM 0.34's, byte for byte, for every kind of model served: vLLM's own
planner groups the model's layers and names each group's kind (``vllm_kv_events_child``), its
own Structs build the events a ``BlockPool`` publishes for each group, and its publisher's
encoder writes the batch; kept are the groups whose kind is a reusable prefix (what llm-d's
scorer accepts). Our batch for the same cache calls, announcing ``kv_event_groups``, is the
same bytes: same groups, same kinds, same fields. Runs vLLM 0.34 in a child process; skipped,
saying why, without ``make vllm-deps``."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, KVLayout
from prefill_worker.kv.state_layout import PAGES, StateComponent, StateRegions, StateTensor
from prefill_worker.kv_events.wire import (
    PREFIX_KINDS,
    AllBlocksCleared,
    KVEvent,
    block_removed,
    block_stored,
    encode_batch,
)
from prefill_worker.model import ModelInfo
from prefill_worker.service.startup import kv_event_groups
from tests.interop.vllm_decode import vllm_pythonpath

pytestmark = pytest.mark.interop

BLOCK, TS, MAX_U64 = 16, 1234.5, 2**64 - 1
CHILD = Path(__file__).with_name("vllm_kv_events_child.py")
DENSE = ModelInfo(
    "LlamaForCausalLM", 128, 512, 2, 8, 2, 64, 128, "float32", "cpu", "sdpa", None, (2,)
)
DSA_KEYS = StateRegions(
    StateComponent("dsa_index", (0, 1), (StateTensor("keys", (16, 132), "uint8", 2112),), 4, PAGES),
    ((0, 0),),
    "cpu",
)


def sliding(architecture: str, layers: str) -> tuple[ModelInfo, str, list[str]]:
    """A sliding-window model whose layer ``i`` slides where ``layers[i]`` is ``s``."""
    info = dataclasses.replace(
        DENSE,
        architecture=architecture,
        num_layers=len(layers),
        sliding_window=32,
        sliding_layers=tuple(i for i, c in enumerate(layers) if c == "s"),
    )
    return info, LAYER_MAJOR, ["sliding:32" if c == "s" else "full" for c in layers]


# name: (our model, our pool's kind, its layers as vLLM sees them)
MODELS = {
    "dense": (DENSE, LAYER_MAJOR, ["full", "full"]),
    "mla": (DENSE, MLA, ["mla", "mla"]),
    "dsa": (dataclasses.replace(DENSE, state_regions=DSA_KEYS), MLA, ["mla"] * 2 + ["indexer"] * 2),
    "gpt-oss-3": sliding("GptOssForCausalLM", "sfs"),
    "gpt-oss-20b": sliding("GptOssForCausalLM", "sf" * 12),
    "gemma-3": sliding("Gemma3ForCausalLM", "sfss"),
    "two-full-groups": sliding("GptOssForCausalLM", "sffsff"),
}

# The cache's calls: a prompt's first run, the run after it, an eviction, a reset.
STORES = [
    ([MAX_U64, 7], None, list(range(2 * BLOCK))),
    ([9], 7, list(range(2 * BLOCK, 3 * BLOCK))),
]
REMOVED = [9, 7]


def our_events(groups) -> list[KVEvent]:
    """What the publisher queues for those calls (one event per announced group)."""
    events: list[KVEvent] = []
    for hashes, parent, tokens in STORES:
        events += [block_stored(hashes, parent, tokens, BLOCK, g) for g in groups]
    events += [block_removed(REMOVED, g) for g in groups]
    return [*events, AllBlocksCleared()]


@pytest.fixture(scope="module")
def vllm_published() -> dict:
    path = vllm_pythonpath("0.34.0")
    calls = [
        {
            "type": "BlockStored",
            "block_hashes": h,
            "parent_block_hash": p,
            "token_ids": t,
            "block_size": BLOCK,
        }
        for h, p, t in STORES
    ]
    calls += [{"type": "BlockRemoved", "block_hashes": REMOVED}, {"type": "AllBlocksCleared"}]
    request = {
        "block_size": BLOCK,
        "ts": TS,
        "events": calls,
        "kinds": sorted(PREFIX_KINDS),
        "models": {name: layers for name, (_, _, layers) in MODELS.items()},
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    done = subprocess.run(
        [sys.executable, str(CHILD)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_our_prefix_kinds_are_vllms(vllm_published) -> None:
    assert set(vllm_published["kinds"]) >= PREFIX_KINDS


@pytest.mark.parametrize("name", list(MODELS))
def test_our_events_are_vllms_bytes(vllm_published, name: str) -> None:
    info, pool_kind, _ = MODELS[name]
    theirs = vllm_published["models"][name]
    groups = kv_event_groups(
        info,
        KVLayout(info.num_layers, 1 if pool_kind == MLA else 2, 64, "float32", BLOCK, 8, pool_kind),
    )
    # we announce exactly vLLM's groups of a prefix kind, by index and kind
    announced = [(i, kind) for i, (kind, _) in enumerate(theirs["groups"]) if kind in PREFIX_KINDS]
    assert [(g.idx, g.kind) for g in groups] == announced
    assert encode_batch(our_events(groups), ts=TS) == base64.b64decode(theirs["payload"])
