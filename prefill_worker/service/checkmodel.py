"""What ``check-config`` can tell about a configuration from its checkpoint's ``config.json``,
without loading weights or touching a device: the architecture is one we serve, weights are
there, their bytes (as shipped, FP8 and scales apart, and per rank: ``model.quant.memory``),
and the KV pool's arithmetic (values and bytes per token, per layer and in all, pages,
tokens) holds the longest prompt.

Two kinds of pool row, per token and layer (docs/config.md, "KV arithmetic")::

    K/V (MHA, GQA; dense and MoE)   2 × num_kv_heads × head_dim values
    MLA latent (DeepSeek-V2/V3)     kv_lora_rank + qk_rope_head_dim values (512 + 64 = 576)

A hybrid model (Qwen3-Next, Qwen3.5) has K/V rows for its full-attention layers only, and a
fixed state per request (one slot per aux row) for its linear-attention layers.

An MLA row is also shown beside the MHA cache it replaces (K and V of every head,
``2 × num_attention_heads × qk_nope_head_dim``: 32768 values for DeepSeek-V3, 56.9× the row).

The checkpoint directory is often absent where configurations are checked (CI, a laptop, a
container build): then the configuration is still checked and valid, and a note says the
checkpoint was not; ``check-config --require-model`` makes the absence an error. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefill_worker.kv.layout import DTYPE_ITEMSIZE, MLA, KVLayout
from prefill_worker.model.hf_config import CheckpointError, ModelSpec, read_spec
from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.model.moe.memory import expert_note, mxfp4_expert_note
from prefill_worker.model.moe.placement import check_expert_parallel
from prefill_worker.model.quant.kv import kv_dtype_name
from prefill_worker.model.quant.memory import weight_note
from prefill_worker.service.schema import Config
from prefill_worker.service.sliding_pool import (
    WINDOWED,
    sliding_pool_note,
    sliding_pool_problem,
    sliding_pool_size,
)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True, slots=True)
class ModelCheck:
    problems: list[str] = field(default_factory=list)  # each one line; any means exit 78
    notes: list[str] = field(default_factory=list)  # what was checked, what was not


@dataclass(frozen=True, slots=True)
class MlaDims:
    """The multi-head latent attention fields the KV arithmetic needs."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_heads: int

    @property
    def row(self) -> int:
        """Values per token per layer in the pool: the normalised latent and the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mha_row(self) -> int:
        """K and V of every head at the head dim MLA compresses (the DeepSeek-V2 paper's
        ``2 n_h d_h``)."""
        return 2 * self.num_heads * self.qk_nope_head_dim

    @property
    def decompressed_row(self) -> int:
        """What attention reads per token once decompressed: K (nope + rope) and V per head."""
        return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What the pool arithmetic needs from a checkpoint, whatever its attention."""

    architecture: str
    num_layers: int
    num_kv_heads: int  # 1 for an MLA pool
    head_dim: int  # kv_lora_rank + qk_rope_head_dim for an MLA pool
    torch_dtype: str | None
    max_position: int
    mla: MlaDims | None = None


LAYOUT_SERVES = {  # cache.layout -> the decodes a pool of it serves (docs/vllm.md, protocol.md)
    "layer_major": "native decodes of the same layout, SGLang decodes, vLLM pull and push "
    "(through the staging region the forward mirrors into)",
    "page_major": "native decodes of the same layout, SGLang decodes, vLLM pull and push "
    "(through the staging region the forward mirrors into)",
    "vllm_blocks": "native decodes of the same layout and TP, vLLM pull and push straight from "
    "the pool (no staging region, at TP 1); not SGLang decodes",
}


def layout_note(config: Config) -> str:
    """Which protocols the configured pool layout serves (an MLA model's pool is ``mla``
    whatever it says: native and SGLang decodes)."""
    layout = config.cache.layout
    served = ", ".join(config.transfer.protocols)
    return f"cache.layout {layout}: serves {LAYOUT_SERVES[layout]}; served here: {served}"


def check_model(config: Config, require_model: bool = False) -> ModelCheck:
    path = Path(config.model.path)
    if not path.is_dir():
        absent = f"model.path {str(path)!r} is not a directory here"
        if require_model:
            return ModelCheck(problems=[absent])
        return ModelCheck(notes=[f"{absent}: its checkpoint was not checked"])
    check = ModelCheck()
    spec: ModelSpec | None = None
    try:
        spec = read_spec(path)
    except CheckpointError as exc:
        check.problems.append(str(exc))
    shape = pool_shape(spec, _raw_config(path))
    if shape is None:
        return check  # neither served nor MLA: read_spec's problem says why
    if not any((path / name).exists() for name in _WEIGHT_FILES):
        check.problems.append(f"{path}: neither {' nor '.join(_WEIGHT_FILES)} found")
    if spec is not None and spec.moe is not None:
        moe = spec.moe
        check.notes.append(
            f"experts: {moe.num_experts} routed, top {moe.top_k}, {moe.num_shared_experts} "
            f"shared, {len(moe.sparse_layers)} of {spec.num_layers} layers sparse "
            f"(KV does not depend on them)"
        )
    index_bytes = 0
    if spec is not None and spec.indexer is not None:
        index_bytes = _index_page_bytes(config, spec, shape.torch_dtype)
        check.notes.append(_index_note(config, spec, index_bytes))
    shape, reserved = _windowed(config, spec, shape, check)
    _check_pool(config, shape, check, index_bytes, reserved)
    if spec is not None:
        _note_weights(config, spec, check)
        _check_experts(config, spec, check)
    if spec is not None and spec.linear is not None:
        check.notes.append(_state_note(config, spec.linear, shape.torch_dtype))
    if spec is not None and spec.sliding is not None and spec.sliding.mxfp4:
        check.notes.append(_mxfp4_note(config, spec))
    return check


def _note_weights(config: Config, spec: ModelSpec, check: ModelCheck) -> None:
    """The weights' bytes, as shipped (FP8 and scales apart) and as one rank holds them."""
    stored = spec.torch_dtype if spec.torch_dtype in DTYPE_ITEMSIZE else "float32"
    dtype: str = config.model.dtype
    if dtype == "auto":
        dtype = stored
    note = weight_note(spec, DTYPE_ITEMSIZE[stored], dtype, DTYPE_ITEMSIZE[dtype],
                       config.parallel.tp_size, config.model.device)  # fmt: skip
    if note is not None:
        check.notes.append(note)


def _check_experts(config: Config, spec: ModelSpec, check: ModelCheck) -> None:
    """Expert parallelism: the placement refused with its reason, or each rank's experts."""
    par = config.parallel
    try:
        placement = check_expert_parallel(
            spec, par.tp_size, par.ep_size, par.expert_placement, par.dp_size
        )
    except ValueError as exc:
        check.problems.append(str(exc))
        return
    if placement is not None:
        dtype = config.model.dtype if config.model.dtype != "auto" else spec.torch_dtype
        dtype = dtype if dtype in DTYPE_ITEMSIZE else "float32"
        itemsize, dp = DTYPE_ITEMSIZE[dtype], par.dp_size > 1
        check.notes.append(expert_note(spec, placement, dtype, itemsize, dp))


def _mxfp4_note(config: Config, spec: ModelSpec) -> str:
    """gpt-oss's MXFP4 experts: their bytes shipped, dequantized and kept, and which applies."""
    model = config.model
    dtype = model.dtype if model.dtype != "auto" else spec.torch_dtype
    dtype = dtype if dtype in DTYPE_ITEMSIZE else "float32"
    may_keep = (
        model.device != "cpu"
        and dtype == "bfloat16"
        and model.moe_backend in ("auto", "flashinfer")
    )
    return mxfp4_expert_note(spec, dtype, DTYPE_ITEMSIZE[dtype], may_keep)


def _state_note(config: Config, linear: LinearAttentionSpec, torch_dtype: str | None) -> str:
    """The state pool's arithmetic: one slot per aux row, each every linear layer's state."""
    dtype: str = config.model.dtype
    if dtype == "auto":
        dtype = torch_dtype if torch_dtype in DTYPE_ITEMSIZE else "float32"
    slot = linear.slot_bytes(DTYPE_ITEMSIZE[dtype])
    num_slots = config.cache.num_aux_rows
    return (
        f"state pool (hybrid): {len(linear.linear_layers)} linear-attention layers, "
        f"{len(linear.full_layers)} full (the KV pool's); one slot per aux row: {num_slots} "
        f"slots × {slot} bytes (conv {linear.conv_dim} × {linear.conv_kernel - 1} {dtype}, "
        f"recurrent {linear.num_v_heads} × {linear.head_k_dim} × {linear.head_v_dim} float32, "
        f"per layer) = {num_slots * slot / 2**30:.2f} GiB; the prefix cache is off"
        f"{_staging_note(config, linear)}"
        f"{_group_state_note(config, num_slots * slot)}"
    )


def _group_state_note(config: Config, pool_bytes: int) -> str:
    """At TP > 1: each rank's pool holds its heads (1/N of each slot, ``sharding.
    local_linear``), and rank 0 also the whole slots it sends (``model.state_gather``)."""
    tp = config.parallel.tp_size
    if tp == 1:
        return ""
    return (
        f"; at tensor parallel {tp} each rank's pool holds its heads, "
        f"{pool_bytes // tp / 2**30:.2f} GiB, and rank 0 also the whole slots it sends, "
        f"{pool_bytes / 2**30:.2f} GiB more"
    )


def _staging_note(config: Config, linear: LinearAttentionSpec) -> str:
    """SGLang decodes' staging of the state slots (``sglang.mamba_stage``): as many slots, in
    their conv dtype and layout; nothing without the SGLang protocol."""
    if "sglang" not in config.transfer.protocols:
        return ""
    conv_dtype = config.transfer.sglang_mamba_conv_dtype
    slot = linear.slot_bytes(DTYPE_ITEMSIZE[conv_dtype])
    num_slots = config.cache.num_aux_rows
    return (
        f"; SGLang decodes' staging of it (conv in {conv_dtype}, "
        f"transfer.sglang_mamba_conv_dtype): {num_slots} slots × {slot} bytes = "
        f"{num_slots * slot / 2**30:.2f} GiB more"
    )


def pool_shape(spec: ModelSpec | None, raw: dict[str, Any] | None) -> PoolShape | None:
    """An MLA checkpoint's latent row (from ``raw``, even before its family is served), else
    the K/V row of a served ``spec``; None when neither applies."""
    mla = _mla_dims(raw) if raw is not None else None
    if mla is not None and raw is not None:
        archs = raw.get("architectures") or [raw.get("model_type")]
        return PoolShape(
            architecture=str(archs[0]),
            num_layers=int(raw["num_hidden_layers"]),
            num_kv_heads=1,
            head_dim=mla.row,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            max_position=int(raw.get("max_position_embeddings") or 2048),
            mla=mla,
        )
    if spec is None:
        return None
    return PoolShape(
        spec.architecture,
        len(spec.linear.full_layers) if spec.linear is not None else spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.torch_dtype,
        spec.max_position,
    )


def _mla_dims(raw: dict[str, Any]) -> MlaDims | None:
    """DeepSeek-V2/V3's attention fields; None when ``kv_lora_rank`` is absent (not MLA).
    Read here until ``model/hf_config.py`` carries them on ``ModelSpec``."""
    if not raw.get("kv_lora_rank"):
        return None
    return MlaDims(
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        num_heads=int(raw["num_attention_heads"]),
    )


def _raw_config(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # read_spec reported it
    return raw if isinstance(raw, dict) else None


def _index_page_bytes(config: Config, spec: ModelSpec, torch_dtype: str | None) -> int:
    """A DSA model's index keys of one page, every indexed layer (the model's dtype: the
    index cache is not quantized with the KV)."""
    assert spec.indexer is not None
    dtype: str = config.model.dtype
    if dtype == "auto":
        dtype = torch_dtype if torch_dtype in DTYPE_ITEMSIZE else "float32"
    per_token = len(spec.indexer.indexed_layers) * spec.indexer.head_dim * DTYPE_ITEMSIZE[dtype]
    return per_token * config.cache.page_size


def _index_note(config: Config, spec: ModelSpec, page_bytes: int) -> str:
    assert spec.indexer is not None
    idx = spec.indexer
    return (
        f"index cache (DSA): {len(idx.indexed_layers)} indexed layers × index_head_dim "
        f"{idx.head_dim} = {page_bytes // config.cache.page_size} bytes per token beside the "
        f"KV, paged with it (in the KV budget below); each query attends to its top "
        f"{idx.topk} keys; served to native decodes only (their index pool beside the KV)"
    )


def _windowed(
    config: Config, spec: ModelSpec | None, shape: PoolShape, check: ModelCheck
) -> tuple[PoolShape, int]:
    """With ``cache.sliding_pool`` windowed: the pool's shape without the sliding layers and
    the bytes their own pool takes from the budget first (its note, or the problem)."""
    if config.cache.sliding_pool != WINDOWED or spec is None:
        return shape, 0
    if spec.sliding is None:
        check.problems.append("cache.sliding_pool windowed: the model has no sliding layers")
        return shape, 0
    size = sliding_pool_size(config, spec.sliding)
    dtype = shape.torch_dtype if config.model.dtype == "auto" else config.model.dtype
    dtype = kv_dtype_name(config.cache.kv_dtype, dtype or "float32")
    layer_page_bytes = (
        config.cache.page_size * shape.num_kv_heads * shape.head_dim * DTYPE_ITEMSIZE[dtype]
    )
    check.notes.append(sliding_pool_note(size, layer_page_bytes, config.cache.page_size))
    problem = sliding_pool_problem(size)
    if problem is not None:
        check.problems.append(problem)
    reserved = size.num_pages * size.bytes_per_page(layer_page_bytes)
    return dataclasses.replace(shape, num_layers=size.num_full_layers), reserved


def _check_pool(
    config: Config,
    shape: PoolShape,
    check: ModelCheck,
    extra_page_bytes: int = 0,
    reserved_bytes: int = 0,
) -> None:
    """``extra_page_bytes``: what a page also costs beside the pool (a DSA index cache);
    ``reserved_bytes``: what the budget gives first to another pool (a windowed sliding one)."""
    dtype: str = config.model.dtype
    if dtype == "auto":
        dtype = shape.torch_dtype if shape.torch_dtype in DTYPE_ITEMSIZE else "float32"
    dtype = kv_dtype_name(config.cache.kv_dtype, dtype)  # an FP8 pool: 1 byte a value
    cache = config.cache
    kind = MLA if shape.mla is not None else cache.layout
    one_page = KVLayout(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, cache.page_size, 1, kind
    )
    check.notes.extend(_row_notes(shape, one_page))
    bytes_per_page = one_page.pool_bytes + extra_page_bytes  # every layer's K and V (or latent)
    longest = min(config.scheduler.max_prompt_tokens, shape.max_position)
    if config.scheduler.max_prompt_tokens > shape.max_position:
        check.notes.append(
            f"scheduler.max_prompt_tokens {config.scheduler.max_prompt_tokens} is capped at the "
            f"model's {shape.max_position}"
        )
    num_pages = cache.num_pages
    if num_pages is None and cache.memory_bytes is not None:
        num_pages = (cache.memory_bytes - reserved_bytes) // bytes_per_page
        less = f" - {reserved_bytes} (sliding pool)" if reserved_bytes else ""
        check.notes.append(
            f"KV budget: {cache.memory_bytes}{less} bytes / {bytes_per_page} bytes per page of "
            f"{cache.page_size} tokens = {num_pages} pages"
        )
    if num_pages is None:
        check.notes.append("KV pool: sized from free device memory at start-up (memory_fraction)")
        return
    num_tokens = num_pages * cache.page_size
    check.notes.append(
        f"KV pool: {num_pages} pages × {cache.page_size} tokens = {num_tokens} tokens, "
        f"{num_pages * bytes_per_page / 2**30:.2f} GiB"
    )
    if num_tokens < longest:
        check.problems.append(
            f"the KV pool holds {num_tokens} tokens, fewer than the longest prompt accepted "
            f"({longest}): raise cache.num_pages or cache.memory_bytes"
        )


def _row_notes(shape: PoolShape, one_page: KVLayout) -> list[str]:
    """The per-token row: values and bytes per layer, bytes in all layers; for MLA, beside
    the MHA cache it replaces."""
    values = one_page.planes * one_page.num_kv_heads * one_page.head_dim  # per token, layer
    layer_bytes = values * one_page.itemsize
    total = layer_bytes * shape.num_layers
    mla = shape.mla
    if mla is None:
        row = f"K and V: 2 × {shape.num_kv_heads} KV heads × {shape.head_dim}"
    else:
        row = f"MLA latent: kv_lora_rank {mla.kv_lora_rank} + qk_rope_head_dim "
        row += str(mla.qk_rope_head_dim)
    notes = [
        f"model: {shape.architecture}, {shape.num_layers} layers, {one_page.dtype}; "
        f"KV per token per layer: {row} = {values} values, {layer_bytes} bytes; "
        f"{total} bytes of KV per token ({shape.num_layers} layers)"
    ]
    if mla is not None:
        notes.append(
            f"MLA against MHA: an MHA cache of the same {mla.num_heads} heads × "
            f"{mla.qk_nope_head_dim} (K and V: 2 × {mla.num_heads} × {mla.qk_nope_head_dim} = "
            f"{mla.mha_row} values per layer) is {mla.mha_row / mla.row:.1f}× the {mla.row}-value "
            f"latent (the latent is 1/{mla.mha_row / mla.row:.1f} of it); decompressed as "
            f"attention reads it ({mla.num_heads} × ({mla.qk_nope_head_dim} + "
            f"{mla.qk_rope_head_dim} + {mla.v_head_dim}) = {mla.decompressed_row} values) "
            f"{mla.decompressed_row / mla.row:.1f}×"
        )
    return notes
