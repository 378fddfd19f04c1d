"""Checkpoint-shipped KV scales: the ``k_scale`` / ``v_scale`` per attention layer that FP8-KV
checkpoints carry, read for an FP8 pool (``cache.kv_dtype: fp8_e4m3``).

Where the formats put them (layer ``i``'s attention, prefix ``model.layers.i.self_attn.``)::

    format                                   K scale             V scale
    compressed-tensors ``kv_cache_scheme``   k_scale             v_scale
    (llm-compressor; vLLM's own layout)      attn.k_scale        attn.v_scale
    modelopt (``kv_cache_quant_algo`` FP8)   k_proj.k_scale      v_proj.v_scale
    older FP8 releases (one for both)        kv_scale            kv_scale

Each is one float32 value (per tensor; per-head scales are refused). The pool stores
``value / scale`` cast to e4m3 and attention reads ``byte × scale`` back (``quant.kv``), as
SGLang's ``set_kv_buffer(k, v, k_scale, v_scale)`` and vLLM's ``reshape_and_cache`` with the
layer's ``_k_scale`` write and their attention reads. Decodes of those families load the same
scales from the same checkpoint; a native decode's layout hash covers them
(``kv.layout.KVLayout.kv_scales``), so a decode with other scales is refused at registration.

Served where pool layer ``i`` is model layer ``i`` with K and V planes (dense and MoE
attention); a checkpoint shipping scales for an MLA, hybrid or sliding-window model with an
FP8 pool is refused with the reason (their pools, or their decodes' scale rules, differ).
An unquantized pool ignores the scales, as both families do with ``auto``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from prefill_worker.model.hf_config import CheckpointError, ModelSpec
from prefill_worker.model.loader import tensor_files

_PREFIX = "model.layers.{}.self_attn."
_K_NAMES = ("k_scale", "attn.k_scale", "k_proj.k_scale", "kv_scale")
_V_NAMES = ("v_scale", "attn.v_scale", "v_proj.v_scale", "kv_scale")


@dataclass(frozen=True, slots=True)
class KVScales:
    """One K and one V scale per pool layer (what multiplies a stored byte back)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def of(self, layer: int) -> tuple[float, float]:
        return self.k[layer], self.v[layer]

    def flat(self) -> tuple[float, ...]:
        """Every K scale, then every V scale: what the layout hash covers."""
        return self.k + self.v


def scale_names(names: Collection[str], num_layers: int) -> list[tuple[str, str]] | None:
    """Each layer's (K, V) scale tensor names, None when the checkpoint ships none;
    ``CheckpointError`` when some layers have them and others do not."""
    found = [_layer_names(names, layer) for layer in range(num_layers)]
    if all(pair is None for pair in found):
        return None
    missing = [layer for layer, pair in enumerate(found) if pair is None]
    if missing:
        raise CheckpointError(
            f"KV scales (k_scale/v_scale) are shipped for some layers but not layers {missing}"
        )
    return [pair for pair in found if pair is not None]


def _layer_names(names: Collection[str], layer: int) -> tuple[str, str] | None:
    prefix = _PREFIX.format(layer)
    k = next((prefix + n for n in _K_NAMES if prefix + n in names), None)
    v = next((prefix + n for n in _V_NAMES if prefix + n in names), None)
    if (k is None) != (v is None):
        raise CheckpointError(f"layer {layer} ships one of k_scale/v_scale without the other")
    return None if k is None or v is None else (k, v)


def read_kv_scales(
    names: Collection[str], num_layers: int, read: Callable[[str], list[float]]
) -> KVScales | None:
    """The checkpoint's KV scales (``read(name)``: a tensor's values), None when it ships
    none; ``CheckpointError`` for one that is not a single positive finite value."""
    pairs = scale_names(names, num_layers)
    if pairs is None:
        return None
    k = tuple(_one(name, read(name)) for name, _ in pairs)
    v = tuple(_one(name, read(name)) for _, name in pairs)
    return KVScales(k, v)


def _one(name: str, values: list[float]) -> float:
    if len(values) != 1:
        raise CheckpointError(
            f"tensor {name} holds {len(values)} values: only a per-tensor KV scale is served"
        )
    value = values[0]
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"tensor {name} is {value}: a KV scale must be positive and finite")
    return value


def check_served(scales: KVScales | None, family_note: str | None) -> None:
    """Refuse shipped scales for a model whose pool does not take them (``family_note``:
    why; None when it does)."""
    if scales is not None and family_note is not None:
        raise CheckpointError(
            f"the checkpoint ships KV scales (k_scale/v_scale) and cache.kv_dtype is "
            f"fp8_e4m3, but {family_note}: serve it with cache.kv_dtype auto"
        )


def family_note(spec: ModelSpec) -> str | None:
    """Why ``spec``'s pool cannot take per-layer K/V scales; None when it can."""
    if spec.mla is not None:
        return "an MLA pool's latent rows are not scaled (SGLang writes them unscaled)"
    if spec.linear is not None:
        return "a hybrid model's pool layers are not its layers"
    if spec.sliding is not None:
        return "its sliding-window attention backend does not read scales"
    return None


def load_kv_scales(model_dir: Path, spec: ModelSpec) -> KVScales | None:
    """The checkpoint's KV scales for an FP8 pool of ``spec``'s model (None: none shipped),
    refused with the reason where that pool does not take them."""
    files = tensor_files(model_dir)

    def read(name: str) -> list[float]:
        with safe_open(files[name], framework="pt") as handle:
            return [float(x) for x in handle.get_tensor(name).float().flatten().tolist()]

    scales = read_kv_scales(files, spec.num_layers, read)
    check_served(scales, family_note(spec))
    return scales
