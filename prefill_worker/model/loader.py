"""Load a Hugging Face checkpoint (config.json + safetensors) into fused ``ModelWeights``.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are read (a DeepSeek-V3 one's MLA tensors through ``model.mla``, a hybrid
one's through ``model.hybrid_loader``, gpt-oss's and Gemma 3's through
``model.gpt_oss_loader`` and ``model.gemma3_loader``; FP8 weights become what the FP8 backend
makes of them as they are read, ``model.quant.backends``: dequantized with their scales, or on
a Hopper GPU kept as shipped for the block-scaled GEMM). Every
expected tensor's presence and shape is checked before any is loaded; a missing tensor or a
shape mismatch raises ``CheckpointError`` naming it. q/k/v are concatenated into one matrix
and gate/up into another, so a layer runs four GEMMs.

With tensor parallelism (``parallel.TPGroup`` of size > 1) each rank reads only its slice of
each tensor, as its family's table in ``model.sharding`` declares, straight from the file
(safetensors reads a row or column range without the rest); the fused matrices are built
from the slices. Shapes are checked whole, against config.json, before any slice is read.

Loading reports progress through an optional ``on_progress(bytes_read, bytes_total)``
callback, called after each tensor (bytes as stored in the checkpoint); how it is shown (log
lines, systemd's STATUS) is the caller's business.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from prefill_worker.model.deepseek import MLALayerWeights, MLAModelWeights
from prefill_worker.model.dsa_loader import fuse_dsa, indexer_shapes
from prefill_worker.model.gemma3 import Gemma3ModelWeights
from prefill_worker.model.gemma3_loader import fuse_gemma3, gemma3_shapes
from prefill_worker.model.gpt_oss import GptOssModelWeights
from prefill_worker.model.gpt_oss_loader import fuse_gpt_oss, gpt_oss_shapes
from prefill_worker.model.hf_config import CheckpointError, ModelSpec, read_spec
from prefill_worker.model.hybrid_loader import fuse_hybrid, hybrid_shapes
from prefill_worker.model.llama import DenseMLP, LayerWeights, ModelWeights
from prefill_worker.model.mla import fuse_mla, mla_shapes
from prefill_worker.model.moe.block import MoEWeights, fuse_moe, moe_shapes
from prefill_worker.model.moe.placement import ExpertPlacement
from prefill_worker.model.parallel import SINGLE, TPGroup
from prefill_worker.model.quant.backends import (
    Fp8WeightBackend,
    create_fp8_backend,
    select_fp8_backend,
)
from prefill_worker.model.quant.block_gemm import Fp8BlockWeight
from prefill_worker.model.quant.fp8 import FP8_STORED, check_scales, is_fp8
from prefill_worker.model.quant.linear import Weight, cat_rows
from prefill_worker.model.quant.placement import check_cuts
from prefill_worker.model.qwen3_next import HybridModelWeights
from prefill_worker.model.sharding import (
    local_shape,
    routed_expert,
    shard_slice,
    shard_slices,
    split_of,
)

log = logging.getLogger(__name__)

SlidingWeights = GptOssModelWeights | Gemma3ModelWeights
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

LoadProgress = Callable[[int, int], None]
"""``on_progress(bytes_read, bytes_total)``: checkpoint bytes read so far, and in all."""

# Bytes per element of the safetensors dtypes a checkpoint may store.
# Tensors an fp16 model reads in fp32, as transformers keeps them (``_keep_in_fp32_modules``:
# for fp16 only; a bf16 model has them in bf16): the DSA indexer's head weights.
KEEP_IN_FP32 = (".indexer.weights_proj.weight",)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}
_DTYPE_BYTES |= {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape."""
    if spec.linear is not None:
        return hybrid_shapes(spec)
    if spec.sliding is not None:
        return gemma3_shapes(spec) if spec.family == "gemma3" else gpt_oss_shapes(spec)
    hidden, inter, dim = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_heads * dim, spec.num_kv_heads * dim
    shapes = spec.outer_shapes()
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if spec.mla is not None:
            shapes |= mla_shapes(spec.mla, hidden, spec.num_heads, p + "self_attn.")
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (q_out, hidden),
                p + "self_attn.k_proj.weight": (kv_out, hidden),
                p + "self_attn.v_proj.weight": (kv_out, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_out),
            }
        if spec.moe is not None and spec.is_sparse(i):
            shapes |= moe_shapes(spec.moe, hidden, p + "mlp.")
            mlp_bias = False
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
            mlp_bias = spec.has_mlp_bias
        if spec.has_qkv_bias:
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                shapes[f"{p}self_attn.{name}_proj.bias"] = (size,)
        if spec.has_o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if mlp_bias:
            shapes |= {p + f"mlp.{n}_proj.bias": (inter,) for n in ("gate", "up")}
            shapes[p + "mlp.down_proj.bias"] = (hidden,)
        if spec.has_qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (dim,)
            shapes[p + "self_attn.k_norm.weight"] = (dim,)
    if spec.indexer is not None:
        shapes |= indexer_shapes(spec)
    return shapes


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable weight_map: {exc}") from exc
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class TensorSource(Protocol):
    """Named checkpoint tensors, already in the dtype and on the device wanted."""

    def get(self, name: str) -> torch.Tensor: ...

    def linear(self, name: str) -> Weight:
        """A linear layer's weight: ``get``'s, or an FP8 one as the FP8 backend keeps it."""
        ...

    def maybe(self, name: str, needed: bool) -> torch.Tensor | None: ...


class _Reader:
    """Reads named tensors (this rank's slice of each) from their files, cast to one dtype
    and device; tells ``on_read`` (when set) the bytes of each, as stored."""

    def __init__(
        self,
        files: Mapping[str, Path],
        dtype: torch.dtype,
        device: torch.device,
        spec: ModelSpec,
        tp: TPGroup = SINGLE,
        experts: ExpertPlacement | None = None,
        fp8: Fp8WeightBackend | None = None,
        ep_rank: int | None = None,
    ):
        self.files, self.dtype, self.device = files, dtype, device
        self.spec, self.tp = spec, tp
        self.experts = experts  # expert parallelism: routed experts whole, on their owner
        self.ep_rank = tp.rank if ep_rank is None else ep_rank  # this rank among the owners
        self.on_read: Callable[[int], None] | None = None
        # What an FP8 weight becomes (model.quant.backends): the device and checkpoint decide.
        self.fp8 = fp8 or create_fp8_backend(select_fp8_backend(spec, device))
        self._open: dict[Path, safe_open] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def stored_bytes(self, name: str) -> int:
        """The size in its file of what this rank reads (0 for a dtype the table lacks)."""
        piece = self._handle(name).get_slice(name)
        shape = tuple(piece.get_shape())
        expert = routed_expert(name) if self.experts is not None else None
        if expert is not None:
            assert self.experts is not None
            shape = shape if self.experts.owner[expert] == self.ep_rank else (0,)
        else:
            shape = local_shape(self.spec, name, shape, self.tp)
        num_elements = 1
        for size in shape:
            num_elements *= size
        return num_elements * _DTYPE_BYTES.get(piece.get_dtype(), 0)

    def stored_dtype(self, name: str) -> str:
        return str(self._handle(name).get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        weight = self.linear(name)
        if isinstance(weight, Fp8BlockWeight):  # a consumer that takes no FP8: dequantized
            return weight.dequantized(self.dtype)
        return weight

    def linear(self, name: str) -> Weight:
        stored = self._read(name)
        if self.on_read is not None:
            self.on_read(stored.numel() * stored.element_size())
        is_kept = self.dtype == torch.float16 and name.endswith(KEEP_IN_FP32)
        dtype = torch.float32 if is_kept else self.dtype
        if not is_fp8(stored):
            return stored.to(device=self.device, dtype=dtype)
        prepared = self._prepare(name, stored)
        if isinstance(prepared, Fp8BlockWeight):
            weight, scale = (t.to(self.device) for t in (prepared.weight, prepared.scale_inv))
            return Fp8BlockWeight(weight, scale, prepared.kernel)
        return prepared.to(device=self.device, dtype=dtype)

    def maybe(self, name: str, needed: bool) -> torch.Tensor | None:
        return self.get(name) if needed else None

    def _read(self, name: str) -> torch.Tensor:
        dim = self._dim(name)
        if dim is None:
            return self._handle(name).get_tensor(name)
        piece = self._handle(name).get_slice(name)
        runs = [
            piece[(slice(None),) * dim + (cut,)]
            for cut in shard_slices(self.spec, name, self.shape(name), self.tp)
        ]  # one run, or a gated DeltaNet's q, k, v channel runs
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim)

    def _dim(self, name: str) -> int | None:
        """The dimension this rank's slice of ``name`` is cut along (None: whole)."""
        if self.experts is not None and routed_expert(name) is not None:
            return None  # expert parallelism: the owner reads its experts whole
        return None if self.tp.is_single else split_of(self.spec.family, name).dim

    def _cut(self, name: str) -> tuple[int | None, slice]:
        """The dimension this rank's slice of ``name`` is cut along (None: whole), and where."""
        dim = self._dim(name)
        if dim is None:
            return None, slice(None)
        return dim, shard_slice(self.spec, name, self.shape(name), self.tp)

    def _prepare(self, name: str, stored: torch.Tensor) -> torch.Tensor | Fp8BlockWeight:
        assert self.spec.quant is not None  # check_tensors refused FP8 without it
        scale = self.spec.quant.scale_name(name)
        dim, cut = self._cut(name)
        scales = self._handle(scale).get_tensor(scale)
        return self.fp8.prepare(name, stored, scales, self.spec.quant, dim, cut)

    def check_cuts(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Where the FP8 backend keeps blocks: refuse a rank slice that cuts one."""
        if self.fp8.keeps_blocks and self.spec.quant is not None and not self.tp.is_single:
            check_cuts(self.spec.quant, shapes, self._stored_fp8, self._cut)

    def _stored_fp8(self, name: str) -> bool:
        return self.stored_dtype(name) == FP8_STORED

    def _handle(self, name: str) -> safe_open:
        path = self.files[name]
        if path not in self._open:
            if not path.exists():
                raise CheckpointError(f"{path}: shard named in the index is missing")
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]


def check_tensors(spec: ModelSpec, reader: _Reader) -> None:
    """Refuse a checkpoint with a missing tensor or a shape that disagrees with config.json."""
    shapes = expected_shapes(spec)
    check_shapes(shapes, reader)
    check_scales(spec.quant, shapes, reader.stored_dtype, reader.shape, reader.files)
    reader.check_cuts(shapes)


def open_tensors(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup,
    shapes: Mapping[str, tuple[int, ...]],
    fp8: Fp8WeightBackend | None = None,
) -> TensorSource:
    """Rank ``tp.rank``'s slices of the checkpoint's tensors, once each of ``shapes`` is
    found with its shape (``CheckpointError`` otherwise): for a part loaded on its own, as
    a draft layer is (``model.draft``)."""
    reader = _Reader(tensor_files(Path(model_dir)), dtype, device, spec, tp, fp8=fp8)
    check_shapes(shapes, reader)
    check_scales(spec.quant, shapes, reader.stored_dtype, reader.shape, reader.files)
    reader.check_cuts(shapes)
    return reader


def check_shapes(shapes: Mapping[str, tuple[int, ...]], reader: _Reader) -> None:
    for name, shape in shapes.items():
        if name not in reader.files:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        found = reader.shape(name)
        if found != shape:
            raise CheckpointError(f"tensor {name} has shape {list(found)}, expected {list(shape)}")


def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    on_progress: LoadProgress | None = None,
    tp: TPGroup = SINGLE,
    experts: ExpertPlacement | None = None,
    fp8: Fp8WeightBackend | None = None,
    ep_rank: int | None = None,
    keep_mxfp4: bool = False,
) -> tuple[ModelSpec, ModelWeights | MLAModelWeights | HybridModelWeights | SlidingWeights]:
    """Read, check and fuse a checkpoint (rank ``tp.rank``'s slices of it; under expert
    parallelism, ``experts``, only the routed experts rank ``ep_rank`` owns, whole: by default
    ``tp.rank``, an attention-DP rank's own otherwise; gpt-oss's MXFP4 experts kept as shipped
    where ``keep_mxfp4``); raises ``CheckpointError`` on any problem. ``fp8``: what FP8
    weights become (None: the backend ``quant.backends.select_fp8_backend`` picks for the
    device)."""
    root = Path(model_dir)
    spec = read_spec(root)
    reader = _Reader(tensor_files(root), dtype, device, spec, tp, experts, fp8, ep_rank)
    check_tensors(spec, reader)
    if on_progress is not None:
        total = sum(reader.stored_bytes(name) for name in expected_shapes(spec))
        reader.on_read = _counter(on_progress, total)
    local = None if experts is None else experts.local_experts(reader.ep_rank)
    weights = fuse_weights(spec, reader, local, keep_mxfp4)
    log.info("loaded %s: %d layers, %s on %s", spec.architecture, spec.num_layers, dtype, device)
    return spec, weights


def _counter(on_progress: LoadProgress, total: int) -> Callable[[int], None]:
    num_read = 0

    def on_read(nbytes: int) -> None:
        nonlocal num_read
        num_read += nbytes
        on_progress(num_read, total)

    return on_read


def fuse_weights(
    spec: ModelSpec,
    source: TensorSource,
    local_experts: Sequence[int] | None = None,
    keep_mxfp4: bool = False,
) -> ModelWeights | MLAModelWeights | HybridModelWeights | SlidingWeights:
    """The checkpoint's tensors, by HF name, fused into the model's weights (an MLA family's
    ``MLAModelWeights``, a hybrid's ``HybridModelWeights``, else ``ModelWeights``); a sparse
    layer's routed experts: ``local_experts`` only, where given (expert parallelism)."""
    if spec.linear is not None:
        return fuse_hybrid(spec, source.get)
    if spec.sliding is not None:
        if spec.family == "gemma3":
            return fuse_gemma3(spec, source.get)
        return fuse_gpt_oss(spec, source.get, keep_mxfp4)
    embed = source.get("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings else source.get("lm_head.weight")
    if spec.mla is not None:
        mla_layers = tuple(
            _mla_layer(spec, source, i, local_experts) for i in range(spec.num_layers)
        )
        mla = MLAModelWeights(embed, mla_layers, source.get("model.norm.weight"), lm_head)
        return mla if spec.indexer is None else fuse_dsa(spec, mla, source.get)
    layers = tuple(_layer(spec, source, i, local_experts) for i in range(spec.num_layers))
    return ModelWeights(embed, layers, source.get("model.norm.weight"), lm_head)


def _mla_layer(
    spec: ModelSpec, r: TensorSource, index: int, experts: Sequence[int] | None = None
) -> MLALayerWeights:
    assert spec.mla is not None
    p = f"model.layers.{index}."
    return MLALayerWeights(
        input_norm=r.get(p + "input_layernorm.weight"),
        attn=fuse_mla(spec.mla, r.get, p + "self_attn.", r.linear),
        post_norm=r.get(p + "post_attention_layernorm.weight"),
        mlp=_mlp(spec, r, index, p + "mlp.", experts),
    )


def _layer(
    spec: ModelSpec, r: TensorSource, index: int, experts: Sequence[int] | None = None
) -> LayerWeights:
    p = f"model.layers.{index}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv_bias = None
    if spec.has_qkv_bias:
        qkv_bias = torch.cat([r.get(f"{attn}{n}_proj.bias") for n in "qkv"])
    return LayerWeights(
        input_norm=r.get(p + "input_layernorm.weight"),
        qkv=cat_rows([r.linear(f"{attn}{n}_proj.weight") for n in "qkv"]),
        qkv_bias=qkv_bias,
        o=r.linear(attn + "o_proj.weight"),
        o_bias=r.maybe(attn + "o_proj.bias", spec.has_o_bias),
        q_norm=r.maybe(attn + "q_norm.weight", spec.has_qk_norm),
        k_norm=r.maybe(attn + "k_norm.weight", spec.has_qk_norm),
        post_norm=r.get(p + "post_attention_layernorm.weight"),
        mlp=_mlp(spec, r, index, mlp, experts),
    )


def _mlp(
    spec: ModelSpec, r: TensorSource, index: int, mlp: str, experts: Sequence[int] | None
) -> DenseMLP | MoEWeights:
    if spec.moe is not None and spec.is_sparse(index):
        return fuse_moe(spec.moe, r.get, mlp, experts, r.linear)
    gate_up_bias = None
    if spec.has_mlp_bias:
        gate_up_bias = torch.cat([r.get(mlp + "gate_proj.bias"), r.get(mlp + "up_proj.bias")])
    return DenseMLP(
        gate_up=cat_rows([r.linear(mlp + "gate_proj.weight"), r.linear(mlp + "up_proj.weight")]),
        gate_up_bias=gate_up_bias,
        down=r.linear(mlp + "down_proj.weight"),
        down_bias=r.maybe(mlp + "down_proj.bias", spec.has_mlp_bias),
    )
