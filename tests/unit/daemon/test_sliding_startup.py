"""What start-up hands the transfer of a sliding-window model: its sliding layers and what a
decode keeps of them; SGLang decodes get them only where SGLang runs the model on a hybrid
SWA pool (gpt-oss), so a Gemma 3 decode that registered one would be refused."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_worker.model import ModelInfo
from prefill_worker.service.startup import sglang_sliding, sliding_model
from prefill_worker.transfer.swa_window import SlidingLayers

DENSE = ModelInfo(
    "LlamaForCausalLM", 128, 512, 3, 8, 4, 16, 128, "float32", "cpu", "sdpa", None, (2,)
)
GPT_OSS = dataclasses.replace(
    DENSE, architecture="GptOssForCausalLM", sliding_window=24, sliding_layers=(0, 2)
)


def test_a_sliding_model_is_its_layers_and_the_decodes_window() -> None:
    sliding = sliding_model(GPT_OSS)
    assert sliding is not None
    assert sliding.layers == SlidingLayers((0, 2), 3, 23)  # a decode keeps window - 1
    assert sliding.layers.full == (1,)
    assert sliding_model(DENSE) is None


def test_sglang_decodes_get_the_window_for_gpt_oss_only() -> None:
    assert sglang_sliding(sliding_model(GPT_OSS)) == SlidingLayers((0, 2), 3, 23)
    gemma = dataclasses.replace(GPT_OSS, architecture="Gemma3ForCausalLM")
    assert sglang_sliding(sliding_model(gemma)) is None
    assert sglang_sliding(None) is None


def test_a_windowed_pool_names_its_pages_and_refuses_a_full_pool_model() -> None:
    layers = sglang_sliding(sliding_model(GPT_OSS), pool_pages=12)
    assert layers == SlidingLayers((0, 2), 3, 23, pool_pages=12)
    gemma = dataclasses.replace(GPT_OSS, architecture="Gemma3ForCausalLM")
    with pytest.raises(ValueError, match="Gemma3ForCausalLM on a full pool"):
        sglang_sliding(sliding_model(gemma), pool_pages=12)
