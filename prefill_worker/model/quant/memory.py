"""Weight memory from ``config.json`` alone (``check-config`` has no weights to read): every
matrix the model loads, whether it is FP8 in a quantized checkpoint, and how it splits over
tensor-parallel ranks. Torch-free.

    in the checkpoint   FP8 matrices 1 byte per parameter, their float32 scales (4 bytes per
                        block, channel or tensor), the rest (embeddings, lm_head, the router,
                        norms) in the checkpoint's dtype
    resident per rank   every matrix in the model's dtype (FP8 is dequantized at load), a split
                        matrix's 1/tp share, a replicated one (embeddings, lm_head, the router,
                        MLA's q_a/kv_a) whole

Hybrid families (their linear-attention layers) are not counted: ``weight_memory`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.quant.spec import BLOCK, CHANNEL, QuantSpec

GiB = 2**30


@dataclass(frozen=True, slots=True)
class Matrix:
    rows: int
    columns: int
    count: int = 1  # identical matrices (experts, layers)
    split: int | None = None  # the dimension TP cuts; None: replicated
    is_linear: bool = True  # a projection (FP8 in a quantized checkpoint); False: kept as is

    @property
    def num_params(self) -> int:
        return self.rows * self.columns * self.count

    def local_params(self, tp_size: int) -> int:
        return self.num_params if self.split is None else -(-self.num_params // tp_size)


@dataclass(frozen=True, slots=True)
class WeightMemory:
    num_params: int
    num_fp8_params: int  # 0 unquantized
    scale_bytes: int
    local_params: int  # one rank's, at the TP size asked
    local_fp8_params: int  # of which FP8 in the checkpoint
    local_scale_bytes: int

    def checkpoint_bytes(self, itemsize: int) -> int:
        """As shipped: FP8 (1 byte), scales, the rest at ``itemsize``."""
        rest = self.num_params - self.num_fp8_params
        return self.num_fp8_params + self.scale_bytes + rest * itemsize

    def local_fp8_bytes(self, itemsize: int) -> int:
        """One rank's weights were its FP8 kept in FP8 (a block-scaled GEMM backend)."""
        rest = self.local_params - self.local_fp8_params
        return self.local_fp8_params + self.local_scale_bytes + rest * itemsize


def weight_note(
    spec: ModelSpec, checkpoint_itemsize: int, dtype: str, itemsize: int, tp_size: int
) -> str | None:
    """``check-config``'s line: the weights as shipped and as one rank holds them."""
    memory = weight_memory(spec, tp_size)
    if memory is None:
        return None
    resident = (
        f"resident per rank (TP {tp_size}) in {dtype}: {_gib(memory.local_params * itemsize)}"
    )
    head = f"weights: {memory.num_params / 1e9:.2f} B parameters"
    if spec.quant is None:
        return (
            f"{head}, {_gib(memory.num_params * checkpoint_itemsize)} in the checkpoint; {resident}"
        )
    quant, rest = spec.quant, memory.num_params - memory.num_fp8_params
    kind = f"block {quant.block[0]} × {quant.block[1]}" if quant.block else quant.strategy
    return (
        f"{head}; as shipped (quant_method {quant.method}, {kind}): "
        f"{memory.num_fp8_params / 1e9:.2f} B FP8 = {_gib(memory.num_fp8_params)} + "
        f"scales {_gib(memory.scale_bytes)} + "
        f"{rest / 1e9:.2f} B others = {_gib(rest * checkpoint_itemsize)}, in all "
        f"{_gib(memory.checkpoint_bytes(checkpoint_itemsize))}; {resident}, dequantized at "
        f"load (kept in FP8 by an FP8 GEMM backend, none registered yet: "
        f"{_gib(memory.local_fp8_bytes(checkpoint_itemsize))})"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def weight_memory(spec: ModelSpec, tp_size: int = 1) -> WeightMemory | None:
    if spec.linear is not None:
        return None
    matrices = model_matrices(spec)
    fp8 = [m for m in matrices if m.is_linear] if spec.quant is not None else []
    return WeightMemory(
        num_params=sum(m.num_params for m in matrices),
        num_fp8_params=sum(m.num_params for m in fp8),
        scale_bytes=sum(4 * _num_scales(spec.quant, m, 1) for m in fp8),
        local_params=sum(m.local_params(tp_size) for m in matrices),
        local_fp8_params=sum(m.local_params(tp_size) for m in fp8),
        local_scale_bytes=sum(4 * _num_scales(spec.quant, m, tp_size) for m in fp8),
    )


def _num_scales(quant: QuantSpec | None, matrix: Matrix, tp_size: int) -> int:
    """The scales of ``matrix`` one rank holds (a split one: those of its 1/tp share)."""
    assert quant is not None
    shape = [matrix.rows, matrix.columns]
    if matrix.split is not None:
        shape[matrix.split] = -(-shape[matrix.split] // tp_size)
    if quant.strategy == CHANNEL:
        return shape[0] * matrix.count
    if quant.strategy == BLOCK and quant.block is not None:
        block_rows, block_columns = quant.block
        return -(-shape[0] // block_rows) * -(-shape[1] // block_columns) * matrix.count
    return matrix.count


def model_matrices(spec: ModelSpec) -> list[Matrix]:
    """Every weight of a dense, MoE or MLA model (norm vectors as one-row matrices)."""
    hidden, num_layers = spec.hidden_size, spec.num_layers
    out = [Matrix(spec.vocab_size, hidden, is_linear=False)]  # the embeddings
    if not spec.tie_word_embeddings:
        out.append(Matrix(spec.vocab_size, hidden, is_linear=False))
    out.append(Matrix(1, hidden, 2 * num_layers + 1, is_linear=False))  # the norms
    out += _attention(spec)
    num_sparse = len(spec.moe.sparse_layers) if spec.moe is not None else 0
    out += _mlp(hidden, spec.intermediate_size, num_layers - num_sparse)
    if spec.moe is not None and num_sparse:
        moe = spec.moe
        out += _mlp(hidden, moe.intermediate_size, num_sparse * moe.num_experts)
        out.append(Matrix(moe.num_experts, hidden, num_sparse, is_linear=False))  # the router
        if moe.num_shared_experts:
            out += _mlp(hidden, moe.num_shared_experts * moe.intermediate_size, num_sparse)
    return out


def _mlp(hidden: int, width: int, count: int) -> list[Matrix]:
    if not count:
        return []
    return [Matrix(width, hidden, 2 * count, split=0), Matrix(hidden, width, count, split=1)]


def _attention(spec: ModelSpec) -> list[Matrix]:
    hidden, n, heads = spec.hidden_size, spec.num_layers, spec.num_heads
    mla = spec.mla
    if mla is None:
        q, kv = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [Matrix(q, hidden, n, 0), Matrix(kv, hidden, 2 * n, 0), Matrix(hidden, q, n, 1)]
    out = [
        Matrix(mla.latent_dim, hidden, n),  # kv_a_proj_with_mqa: replicated
        Matrix(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, n, 0),
        Matrix(hidden, heads * mla.v_head_dim, n, 1),
        Matrix(1, mla.kv_lora_rank + (mla.q_lora_rank or 0), n, is_linear=False),  # a norms
    ]
    if mla.q_lora_rank is None:
        return [*out, Matrix(heads * mla.qk_head_dim, hidden, n, 0)]
    return [*out, Matrix(mla.q_lora_rank, hidden, n), Matrix(heads * mla.qk_head_dim,
                                                             mla.q_lora_rank, n, 0)]  # fmt: skip
