"""FP8 checkpoints (DeepSeek's block-scaled format, ``compressed-tensors``' per-channel and
per-tensor) through our loader and runner against ``transformers`` loading the same weights
dequantized (``tests/fp8_checkpoints.py``), in float32.

DeepSeek-V3 (MLA, MoE), Qwen3 and Qwen3-Next (a hybrid: its linear-attention projections in FP8
too; logits only) shapes; blocks smaller than 128 as well as 128 (on these tiny
matrices 128 is one partial block each), and blocks that the matrices' sizes do not divide, so
the last block row and column are partial. The last token's logits and every layer's K/V (the
MLA latent rows) are within 1e-4 of transformers'; the source checkpoint before quantization is
far from both, so a loader that skipped the scales or read the wrong ones would fail.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from prefill_worker.model.hf_config import CheckpointError
from prefill_worker.model.loader import load_checkpoint
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.integration.model.conftest import (
    chunk,
    hf_forward,
    hf_mla_forward,
    hf_model,
    ours,
    paged_kv,
    plan,
    prompt,
    scattered_pages,
)

TOL = 1e-4
CASES = {
    "deepseek_v3_block32": ("deepseek_v3", (32, 32), "block"),
    "deepseek_v3_block128": ("deepseek_v3", (128, 128), "block"),
    "qwen3_block48": ("qwen3", (48, 48), "block"),
    "qwen3_channel": ("qwen3", None, "channel"),
    "qwen3_tensor": ("qwen3", None, "tensor"),
    "qwen3_next_block16": ("qwen3_next", (16, 16), "block"),  # a hybrid: logits only
}
IDS = prompt(45, seed=1)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:  # type: ignore[no-untyped-def]
    family, block, strategy = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    fp8, reference = make_fp8_checkpoint(family, root, block=block, strategy=strategy)
    return family, fp8, reference


def reference_forward(family: str, path: Path):  # type: ignore[no-untyped-def]
    """transformers' (logits, per-layer [(K, V)] or MLA rows) of ``IDS``."""
    forward = hf_mla_forward if family == "deepseek_v3" else hf_forward
    return forward(hf_model(path), IDS)


def test_logits_and_kv_match_transformers_on_the_dequantized_weights(case):
    family, fp8, reference = case
    runner, kv_cache, _ = ours(fp8)
    pages = scattered_pages(0, 3)
    whole = dataclasses.replace(chunk("a", IDS, 0, len(IDS), pages, last=True), state_slot=0)
    logits = runner.compute_logits(plan(whole))
    if family == "qwen3_next":  # its linear layers keep a state, not K/V: the logits say it
        with torch.no_grad():
            hf_logits = hf_model(reference)(torch.tensor([IDS])).logits[0]
            source = hf_model(fp8.parent / "source")(torch.tensor([IDS])).logits[0]
        torch.testing.assert_close(logits[0], hf_logits[-1], atol=TOL, rtol=0)
        assert (source[-1] - hf_logits[-1]).abs().max() > 100 * TOL
        return
    hf_logits, hf_kv = reference_forward(family, reference)
    torch.testing.assert_close(logits[0], hf_logits[-1], atol=TOL, rtol=0)
    for layer, expected in enumerate(hf_kv):
        if family == "deepseek_v3":  # one latent row per token
            rows = torch.cat([kv_cache.k[layer][p] for p in pages])[: len(IDS), 0]
            torch.testing.assert_close(rows, expected, atol=TOL, rtol=1e-5)
            continue
        k, v = paged_kv(kv_cache, pages, len(IDS), layer)
        torch.testing.assert_close(k, expected[0], atol=TOL, rtol=0)
        torch.testing.assert_close(v, expected[1], atol=TOL, rtol=0)
    source_logits, _ = reference_forward(family, fp8.parent / "source")
    assert (source_logits[-1] - hf_logits[-1]).abs().max() > 100 * TOL  # FP8 moved them


def test_fp8_weights_are_loaded_in_the_model_dtype(case):
    _, fp8, reference = case
    _, weights = load_checkpoint(fp8, torch.bfloat16, torch.device("cpu"))
    _, plain = load_checkpoint(reference, torch.bfloat16, torch.device("cpu"))
    ours_all, plain_all = tensors(weights), tensors(plain)
    assert len(ours_all) == len(plain_all) > 10
    assert sum(t.dtype == torch.bfloat16 for t in ours_all) > 10
    for got, expected in zip(ours_all, plain_all, strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)  # bf16 of the same float32 products


def tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in a weights dataclass, depth first."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in tensors(item)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in tensors(getattr(value, f.name))]
    return []


def _drop(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors.pop(name)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_scale_is_refused_naming_it(tmp_path):
    fp8, _ = make_fp8_checkpoint("qwen3", tmp_path, block=(48, 48))
    _drop(fp8, "model.layers.1.mlp.down_proj.weight_scale_inv")
    with pytest.raises(CheckpointError, match=r"down_proj.weight is FP8 but its scale .* missing"):
        load_checkpoint(fp8, torch.float32, torch.device("cpu"))


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    fp8, _ = make_fp8_checkpoint("qwen3", tmp_path, block=(48, 48))
    config = (fp8 / "config.json").read_text()
    (fp8 / "config.json").write_text(config.replace('"quantization_config"', '"unused"'))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_checkpoint(fp8, torch.float32, torch.device("cpu"))


def test_a_scale_of_the_wrong_block_size_is_refused(tmp_path):
    fp8, _ = make_fp8_checkpoint("qwen3", tmp_path, block=(48, 48))
    config = (fp8 / "config.json").read_text()
    (fp8 / "config.json").write_text(config.replace("48,\n      48", "32,\n      32"))
    with pytest.raises(CheckpointError, match=r"expected \[4, 2\] .* in blocks of \[32, 32\]"):
        load_checkpoint(fp8, torch.float32, torch.device("cpu"))
