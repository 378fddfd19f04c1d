"""Tiny random FP8 checkpoints, made as the shipped ones are: a random checkpoint of a family
(``tests/checkpoints.py``, float32) has every linear layer's weight quantized to
float8_e4m3fn with a float32 scale per block (DeepSeek's ``weight_scale_inv``, the factor that
dequantizes), per output channel or per tensor (``compressed-tensors``' ``weight_scale``).

Each call writes two checkpoints beside each other: ``fp8/`` as a quantized release ships
(FP8 weights, their scales, the rest in its own dtype, a ``quantization_config``) and
``reference/``, the same weights dequantized here to float32 in a plain checkpoint, which
``transformers`` loads as the reference. The dequantization here is written independently of
the worker's (block by block on padded views, not by indexing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_checkpoint

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The linear layers' weights (attention, MLP, experts, shared experts, a hybrid's linear
    attention projections); not the router (``mlp.gate.weight``), a shared expert's gate, the
    embeddings, ``lm_head``, a conv or any norm, as the FP8 releases ship."""
    return tensor.ndim == 2 and "_proj" in name and name.endswith(".weight")


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """``weight`` [out, in] -> (float8_e4m3fn [out, in], scale_inv [ceil(out/bo), ceil(in/bi)])
    with each block's largest magnitude at 448, as DeepSeek's quantizer does."""
    padded, (rows, cols) = _pad(weight.float(), block), weight.shape
    blocks = _blocks(padded, block)  # [R, bo, C, bi]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [R, C]
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.reshape(padded.shape)[:rows, :cols].contiguous(), scale


def dequantize_blocks(fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):  # type: ignore[no-untyped-def]
    rows, cols = fp8.shape
    blocks = _blocks(_pad(fp8.float(), block), block) * scale[:, None, :, None]
    return blocks.reshape(-1, blocks.shape[2] * block[1])[:rows, :cols].contiguous()


def quantize_channels(weight: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, ...]:
    """``compressed-tensors``' FP8: one scale per output row ([out, 1]) or per tensor ([1])."""
    amax = weight.abs().amax() if per_tensor else weight.abs().amax(dim=1, keepdim=True)
    scale = (amax.clamp(min=1e-12) / FP8_MAX).float().reshape(-1 if per_tensor else (-1, 1))
    return (weight / scale).to(torch.float8_e4m3fn), scale


def _pad(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = (-(-n // b) * b for n, b in zip(weight.shape, block, strict=True))
    out = torch.zeros(rows, cols, dtype=weight.dtype)
    out[: weight.shape[0], : weight.shape[1]] = weight
    return out


def _blocks(padded: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = padded.shape
    return padded.reshape(rows // block[0], block[0], cols // block[1], block[1])


def block_config(block: tuple[int, int]) -> dict:
    """DeepSeek-V3's ``quantization_config`` (its block size)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block)}  # fmt: skip


def compressed_config(strategy: str) -> dict:
    """A ``compressed-tensors`` FP8 config (llm-compressor's FP8_DYNAMIC scheme)."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False}  # fmt: skip
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    group = {"weights": weights, "input_activations": activations, "targets": ["Linear"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


def make_fp8_checkpoint(
    family: str, root: Path, block: tuple[int, int] | None = (128, 128), strategy: str = "block",
    **overrides: object,
) -> tuple[Path, Path]:  # fmt: skip
    """(the FP8 checkpoint, its float32 reference) of a random ``family`` checkpoint: ``block``
    for DeepSeek's format, else ``strategy`` "channel" or "tensor" of ``compressed-tensors``."""
    source = make_checkpoint(family, root / "source", **overrides)
    return quantize_checkpoint(source, root, block, strategy)


def quantize_checkpoint(
    source: Path, root: Path, block: tuple[int, int] | None = (128, 128), strategy: str = "block"
) -> tuple[Path, Path]:
    """``root/fp8`` and ``root/reference`` from the single-file checkpoint ``source``."""
    fp8: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        fp8[name] = reference[name] = tensor
        if not is_quantized(name, tensor):
            continue
        stem = name.removesuffix("weight")
        if block is not None:
            fp8[name], fp8[stem + "weight_scale_inv"] = quantize_blocks(tensor, block)
            reference[name] = dequantize_blocks(fp8[name], fp8[stem + "weight_scale_inv"], block)
        else:
            fp8[name], fp8[stem + "weight_scale"] = quantize_channels(tensor, strategy == "tensor")
            reference[name] = fp8[name].float() * fp8[stem + "weight_scale"]
        reference[name] = reference[name].to(tensor.dtype)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = block_config(block) if block else compressed_config(strategy)
    return (
        _write(source, root / "fp8", fp8, config),
        _write(source, root / "reference", reference, None),
    )


def _write(source: Path, path: Path, tensors: dict, config: dict | None) -> Path:
    shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
