"""Which KV-cache groups the KV events announce a cached page in, per model kind: the
full-attention groups only, numbered as a vLLM 0.34 decode numbers them
(``transfer/vllm/groups.py``, proven against vLLM's own planner by the vLLM interop tests),
named with vLLM's kinds (the same events out of vLLM's own code:
``tests/interop/test_vllm_kv_events.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, KVLayout
from prefill_worker.kv.state_layout import (
    LINEAR_STATE,
    PAGES,
    StateComponent,
    StateRegions,
    StateTensor,
)
from prefill_worker.kv_events.wire import EventGroup
from prefill_worker.model import ModelInfo
from prefill_worker.service.startup import kv_event_groups

DENSE = ModelInfo(
    "LlamaForCausalLM", 128, 512, 4, 8, 4, 16, 128, "float32", "cpu", "sdpa", None, (2,)
)
FULL = "full_attention"


def layout(num_layers: int, kind: str = LAYER_MAJOR) -> KVLayout:
    heads = 1 if kind == MLA else 4
    return KVLayout(num_layers, heads, 16, "float32", 16, 32, kind)


def state(kind: str, layer_ids: tuple[int, ...], copy: str = "slot") -> StateRegions:
    tensor = StateTensor("conv", (4, 3), "float32", 48)
    component = StateComponent(kind, layer_ids, (tensor,), 2, copy)
    return StateRegions(component, ((0,) * len(layer_ids),), "cpu")


def test_a_dense_model_is_group_0() -> None:
    assert kv_event_groups(DENSE, layout(4)) == (EventGroup(0, FULL),)


def test_an_mla_model_and_a_dsa_model_are_one_mla_group() -> None:
    """vLLM puts DSA's latents and index keys in one group (both MLA specs): group 0."""
    assert kv_event_groups(DENSE, layout(4, MLA)) == (EventGroup(0, "mla_attention"),)
    dsa = dataclasses.replace(DENSE, state_regions=state("dsa_index", (0, 1, 2, 3), PAGES))
    assert kv_event_groups(dsa, layout(4, MLA)) == (EventGroup(0, "mla_attention"),)


@pytest.mark.parametrize(
    ("architecture", "num_layers", "sliding", "full_group"),
    [
        ("GptOssForCausalLM", 3, (0, 2), 2),  # groups [L0] [L2] [L1]
        ("GptOssForCausalLM", 24, tuple(range(0, 24, 2)), 1),  # [L0 L2 ..] [L1 L3 ..]
        ("Gemma3ForCausalLM", 4, (0, 2, 3), 3),  # [L0] [L2] [L3] [L1]
    ],
)
def test_a_sliding_model_announces_its_full_group_only(
    architecture: str, num_layers: int, sliding: tuple[int, ...], full_group: int
) -> None:
    info = dataclasses.replace(
        DENSE,
        architecture=architecture,
        num_layers=num_layers,
        sliding_window=24,
        sliding_layers=sliding,
    )
    assert kv_event_groups(info, layout(num_layers)) == (EventGroup(full_group, FULL),)


def test_a_model_with_more_full_layers_announces_each_full_group() -> None:
    """Four full layers beside two sliding ones: vLLM splits the full ones in two groups, and
    publishes a block in both."""
    info = dataclasses.replace(DENSE, num_layers=6, sliding_window=24, sliding_layers=(0, 3))
    assert kv_event_groups(info, layout(6)) == (EventGroup(1, FULL), EventGroup(2, FULL))


def test_a_linear_hybrid_names_its_full_attention_group() -> None:
    """Qwen3-Next's 3 GDN layers to 1 attention layer: 3 mamba groups, then the attention
    one. (Its requests bypass the prefix cache, so nothing is published: the group is what
    it would be.)"""
    info = dataclasses.replace(DENSE, state_regions=state(LINEAR_STATE, (0, 1, 2)))
    assert kv_event_groups(info, layout(1)) == (EventGroup(3, FULL),)
