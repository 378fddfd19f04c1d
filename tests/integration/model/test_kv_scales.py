"""Checkpoint-shipped KV scales (``model.quant.kv_scales``) with an FP8 pool: a tiny Qwen3
checkpoint given a ``k_scale``/``v_scale`` per layer (layer 0 under compressed-tensors'
names ``self_attn.k_scale``, layer 1 under modelopt's ``self_attn.k_proj.k_scale``).

The pool's bytes equal the float32 K/V of the same forward divided by the layer's scale and
cast to e4m3 (vLLM's ``reshape_and_cache`` rule, and SGLang's ``set_kv_buffer`` for a float32
model); a later chunk reads them back multiplied by the scale: its logits equal a reference
whose prefix K/V went through that round trip, and are far from one that forgets the
multiply. The native layout hash covers the scales. Refused with the reason: scales for an
MLA model's FP8 pool, scales for some layers only, per-head scales."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefill_worker.model import build
from prefill_worker.model.hf_config import CheckpointError
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import PAGE_SIZE, chunk, plan, prompt

E4M3 = torch.float8_e4m3fn
K_SCALES = tuple(torch.tensor([0.05, 0.4]).tolist())  # as float32 holds them
V_SCALES = tuple(torch.tensor([0.1, 2.0]).tolist())
NAMES = (("self_attn.k_scale", "self_attn.v_scale"),
         ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"))  # fmt: skip
IDS = prompt(45, seed=3)
PAGES = [5, 2, 7]


def add_scales(path: Path, scales: dict[str, torch.Tensor]) -> Path:
    tensors = load_file(path / "model.safetensors") | scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def shipped(num_layers: int = 2) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(num_layers):
        k_name, v_name = NAMES[layer]
        prefix = f"model.layers.{layer}."
        out[prefix + k_name] = torch.tensor(K_SCALES[layer])  # a 0-d float32, as shipped
        out[prefix + v_name] = torch.tensor([V_SCALES[layer]])
    return out


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_scales(make_checkpoint("qwen3", tmp_path_factory.mktemp("scaled")), shipped())


def ours(path: Path, kv_dtype: str = "fp8_e4m3"):  # type: ignore[no-untyped-def]
    return build(path, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=8,
                 kv_dtype=kv_dtype)  # fmt: skip


def rows(pool: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([pool[p] for p in PAGES])[:length]


def test_the_pool_holds_kv_over_the_scale_cast_to_e4m3(scaled: Path) -> None:
    runner, cache, _ = ours(scaled)
    plain_runner, plain, _ = ours(scaled, "auto")
    assert cache.layout.kv_scales == (*K_SCALES, *V_SCALES)
    assert plain.layout.kv_scales == ()  # an unquantized pool ignores them, as decodes do
    unscaled = dataclasses.replace(cache.layout, kv_scales=())
    assert cache.layout.compat_hash() != unscaled.compat_hash()  # a native decode must agree
    for run in (runner, plain_runner):
        run.run(plan(chunk("a", IDS, 0, len(IDS), PAGES, True)))
    for layer in range(2):
        for got, want, scale in ((cache.k, plain.k, K_SCALES), (cache.v, plain.v, V_SCALES)):
            expected = (rows(want[layer], len(IDS)) / scale[layer]).clamp(-448, 448).to(E4M3)
            stored = rows(got[layer], len(IDS))
            assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8)), layer
            unscaled_bytes = rows(want[layer], len(IDS)).to(E4M3).view(torch.uint8)
            assert not torch.equal(stored.view(torch.uint8), unscaled_bytes)  # scales used


def test_a_later_chunk_reads_the_pages_back_times_the_scale(scaled: Path) -> None:
    first, second = chunk("a", IDS, 0, 32, PAGES, False), chunk("a", IDS, 32, 45, PAGES, True)
    runner, _, _ = ours(scaled)
    runner.run(plan(first))
    got = runner.compute_logits(plan(second))[0]
    plain_runner, plain, _ = ours(scaled, "auto")
    plain_runner.run(plan(first))
    exact = plain_runner.compute_logits(plan(second))[0]
    saved = [pool[PAGES[:2]].clone() for pool in (*plain.k, *plain.v)]
    scales = (*K_SCALES, *V_SCALES)
    for pool, scale in zip((*plain.k, *plain.v), scales, strict=True):  # the dequantized prefix
        pool[PAGES[:2]] = (pool[PAGES[:2]] / scale).to(E4M3).float() * scale
    dequantized = plain_runner.compute_logits(plan(second))[0]
    torch.testing.assert_close(got, dequantized, atol=1e-4, rtol=0)
    assert (got - exact).abs().max() > 1e-4  # the FP8 rounding was read
    for pool, old, scale in zip((*plain.k, *plain.v), saved, scales, strict=True):
        pool[PAGES[:2]] = (old / scale).to(E4M3).float()  # the bytes, not multiplied back
    forgotten = plain_runner.compute_logits(plan(second))[0]
    assert (got - forgotten).abs().max() > 100 * (got - dequantized).abs().max()


def test_scales_an_fp8_pool_does_not_take_are_refused(tmp_path: Path) -> None:
    mla = make_checkpoint("deepseek_v3", tmp_path / "mla")
    num_layers = json.loads((mla / "config.json").read_text())["num_hidden_layers"]
    every = {f"model.layers.{i}.self_attn.{n}": torch.tensor(0.5)
             for i in range(num_layers) for n in ("k_scale", "v_scale")}  # fmt: skip
    add_scales(mla, every)
    with pytest.raises(CheckpointError, match="an MLA pool's latent rows are not scaled"):
        ours(mla)
    ours(mla, "auto")  # unquantized: the scales are not read
    some = add_scales(make_checkpoint("qwen3", tmp_path / "some"), shipped(1))
    with pytest.raises(CheckpointError, match=r"not layers \[1\]"):
        ours(some)
    per_head = shipped() | {"model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2])}
    heads = add_scales(make_checkpoint("qwen3", tmp_path / "heads"), per_head)
    with pytest.raises(CheckpointError, match="only a per-tensor KV scale is served"):
        ours(heads)
