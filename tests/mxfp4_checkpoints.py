"""gpt-oss checkpoints with their experts as shipped (MXFP4 blocks and scales), made from a
tiny random one (``tests/checkpoints.py``), and transformers' own dequantization of them:
for the model tests (``tests/integration/model/test_gpt_oss_vs_hf.py``), the packing's unit
tests and the GPU kernel's (``tests/gpu/test_mxfp4_cuda.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prefill_worker.model.moe.mxfp4 import FP4_VALUES


def quantized(checkpoint: Path, root: Path) -> tuple[Path, Path]:
    """The checkpoint with its experts as MXFP4 blocks and scales (``mxfp4/``), and the same
    with those experts dequantized by transformers' own MXFP4 code (``reference/``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(checkpoint / "model.safetensors")
    packed, reference = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(tensors[name].transpose(1, 2))  # [E, out, in] quantized
        del packed[name]
        packed |= {name + "_blocks": blocks, name + "_scales": scales}
        reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    config = json.loads((checkpoint / "config.json").read_text())
    out = []
    for kind, weights in (("mxfp4", packed), ("reference", reference)):
        path = root / kind
        shutil.copytree(checkpoint, path)
        save_file({n: t.contiguous() for n, t in weights.items()}, path / "model.safetensors")
        if kind == "mxfp4":
            quant = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn"],
            }
            (path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
        out.append(path)
    return out[0], out[1]


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, rows, cols]`` -> (blocks ``[E, rows, cols/32, 16]``, scales ``[E, rows,
    cols/32]``) uint8: each 32 values over a shared power of two, each the nearest FP4."""
    groups = w.unflatten(-1, (-1, 32))  # [E, rows, G, 32]
    top = groups.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # [E, rows, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)
