"""Checkpoints the loader must refuse, each with a message naming the problem; pool sizing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefill_worker.model import CheckpointError, build
from prefill_worker.model.kv_cache import pool_num_pages
from tests.integration.model.conftest import ours


def copy_of(checkpoints, family: str, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    dst = tmp_path / family
    shutil.copytree(checkpoints[family], dst)
    return dst


def edit_config(path: Path, **fields: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_wrong_architecture_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints, "llama", tmp_path)
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*not supported"):
        ours(path)


def test_missing_tensor_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints, "llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        ours(path)


def test_shape_mismatch_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints, "qwen3", tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.gate_proj\.weight has shape"):
        ours(path)


def test_missing_shard_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints, "qwen2", tmp_path)
    next(path.glob("model-00003-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard named in the index is missing"):
        ours(path)


def test_unsupported_rope_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints, "mistral", tmp_path)
    edit_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        ours(path)


def test_quantized_checkpoint_is_refused(checkpoints, tmp_path):
    path = copy_of(checkpoints, "llama", tmp_path)
    edit_config(path, quantization_config={"quant_method": "gguf"})
    with pytest.raises(CheckpointError, match=r"quantized checkpoints \(.gguf.\)"):
        ours(path)


@pytest.mark.parametrize("pool_layout", ["layer_major", "page_major"])
def test_kv_pool_layout_and_addresses(checkpoints, pool_layout):
    _, kv_cache, info = ours(checkpoints["qwen3"], pool_layout=pool_layout)
    layout = kv_cache.layout
    assert layout.kind == pool_layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 32)
    assert layout.dtype == "float32" and info.dtype == "float32"
    assert kv_cache.k[0].shape == (layout.num_pages, layout.page_size, 2, 32)
    regions = kv_cache.regions(aux_base_addr=1234, num_aux_rows=8)
    assert regions.device == "cpu"
    for layer in range(layout.num_layers):
        for page in (0, 1, layout.num_pages - 1):
            k, v = kv_cache.read_page(layer, page)
            assert k.data_ptr() == regions.k_base_addrs[layer] + page * layout.page_stride_bytes
            assert v.data_ptr() == regions.v_base_addrs[layer] + page * layout.page_stride_bytes
            assert k.is_contiguous() and v.is_contiguous()  # a page is one byte range
    assert len(set(regions.k_base_addrs + regions.v_base_addrs)) == 2 * layout.num_layers
    stride = layout.page_stride_bytes // layout.itemsize
    assert all(t.stride(0) == stride for t in kv_cache.k + kv_cache.v)  # views, never copies
    if pool_layout == "page_major":  # every layer's K and V of a page are one byte range
        assert regions.region_base_addrs == (regions.k_base_addrs[0],)
        assert stride == 2 * layout.num_layers * layout.page_size * 2 * 32


def test_pool_sized_from_a_byte_budget(checkpoints):
    _, kv_cache, _ = build(checkpoints["llama"], "bfloat16", page_size=8, memory_bytes=100_000)
    layout = kv_cache.layout
    per_page = 2 * layout.num_layers * layout.page_bytes  # 2 * 2 * (8 * 2 * 16 * 2) = 2048
    assert layout.num_pages == 100_000 // per_page
    assert kv_cache.k[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="memory_fraction needs a CUDA device"):
        pool_num_pages(layout, torch.device("cpu"), memory_fraction=0.5)
    with pytest.raises(ValueError, match="holds no page"):
        pool_num_pages(layout, torch.device("cpu"), memory_bytes=100)


def test_flashinfer_is_refused_on_cpu(checkpoints):
    with pytest.raises(ValueError, match="flashinfer' needs a CUDA device"):
        build(checkpoints["llama"], "float32", attention_backend="flashinfer", num_pages=4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # one file; sharded
def test_load_progress_counts_every_stored_byte_once(checkpoints, family: str) -> None:
    calls: list[tuple[int, int]] = []
    build(checkpoints[family], "float32", num_pages=4, on_progress=lambda *c: calls.append(c))
    path = checkpoints[family]
    stored = sum(
        t.numel() * t.element_size()
        for f in sorted(path.glob("*.safetensors"))
        for t in load_file(f).values()
    )
    totals = {total for _, total in calls}
    assert totals == {stored}  # every tensor in the files is one the model reads
    done = [num_read for num_read, _ in calls]
    assert done == sorted(done) and done[-1] == stored and len(calls) > 10
