"""Weight memory from ``config.json`` alone (``check-config`` has no weights to read): every
matrix the model loads, whether it is FP8 in a quantized checkpoint, and how it splits over
tensor-parallel ranks. Torch-free.

    in the checkpoint   FP8 matrices 1 byte per parameter, their float32 scales (4 bytes per
                        block, channel or tensor), the rest (embeddings, lm_head, the router,
                        norms) in the checkpoint's dtype
    resident per rank   a split matrix's 1/tp share, a replicated one (embeddings, lm_head,
                        the router, MLA's q_a/kv_a) whole; on a CPU every matrix in the model's
                        dtype (FP8 dequantized at load); on CUDA, where the block-scaled FP8 GEMM
                        runs (``quant.backends``), the FP8 matrices it keeps (``placement``:
                        128-blocks, whole blocks per rank, not MLA's kv_b) at 1 byte per
                        parameter plus their scales, the rest in the model's dtype

Hybrid families (their linear-attention layers) are not counted: ``weight_memory`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.quant.placement import GEMM_BLOCK, gemm_block
from prefill_worker.model.quant.spec import BLOCK, CHANNEL, QuantSpec

GiB = 2**30


@dataclass(frozen=True, slots=True)
class Matrix:
    rows: int
    columns: int
    count: int = 1  # identical matrices (experts, layers)
    split: int | None = None  # the dimension TP cuts; None: replicated
    is_linear: bool = True  # a projection (FP8 in a quantized checkpoint); False: kept as is
    dense_use: bool = False  # its consumer takes it dense (MLA's kv_b): the GEMM keeps no FP8
    min_share: int = 0  # the least a rank holds of the split (K/V: one head when replicated)

    @property
    def num_params(self) -> int:
        return self.rows * self.columns * self.count

    def local_params(self, tp_size: int) -> int:
        return self.num_params if self.split is None else -(-self.num_params // tp_size)

    def local_shape(self, tp_size: int) -> tuple[int, int]:
        """One rank's share of one of the ``count`` matrices."""
        shape = [self.rows, self.columns]
        if self.split is not None:
            shape[self.split] = -(-shape[self.split] // tp_size)
        return shape[0], shape[1]

    def kept_by_gemm(self, tp_size: int) -> bool:
        """Whether the block-scaled GEMM keeps it in FP8 (``placement.kept_in_fp8``'s rule)."""
        rows, columns = self.local_shape(tp_size)
        whole = rows % GEMM_BLOCK[0] == 0 and columns % GEMM_BLOCK[1] == 0
        return self.is_linear and not self.dense_use and whole


@dataclass(frozen=True, slots=True)
class WeightMemory:
    num_params: int
    num_fp8_params: int  # 0 unquantized
    scale_bytes: int
    local_params: int  # one rank's, at the TP size asked
    local_fp8_params: int  # of which FP8 in the checkpoint
    local_scale_bytes: int
    local_kept_params: int  # of which the block-scaled GEMM keeps in FP8 (0: it takes none)
    local_kept_scale_bytes: int

    def checkpoint_bytes(self, itemsize: int) -> int:
        """As shipped: FP8 (1 byte), scales, the rest at ``itemsize``."""
        rest = self.num_params - self.num_fp8_params
        return self.num_fp8_params + self.scale_bytes + rest * itemsize

    def local_gemm_bytes(self, itemsize: int) -> int:
        """One rank's weights with the block-scaled GEMM: what it keeps in FP8 (1 byte per
        parameter) and their scales, the rest at ``itemsize`` (dequantized, or never FP8)."""
        rest = self.local_params - self.local_kept_params
        return self.local_kept_params + self.local_kept_scale_bytes + rest * itemsize


def weight_note(
    spec: ModelSpec,
    checkpoint_itemsize: int,
    dtype: str,
    itemsize: int,
    tp_size: int,
    device: str = "cpu",
) -> str | None:
    """``check-config``'s line: the weights as shipped and as one rank holds them on
    ``device`` (the configuration's: ``cuda``, ``cuda:N`` or ``auto`` count as CUDA)."""
    memory = weight_memory(spec, tp_size)
    if memory is None:
        return None
    dense_bytes = memory.local_params * itemsize
    resident = f"resident per rank (TP {tp_size}) in {dtype}: {_gib(dense_bytes)}"
    head = f"weights: {memory.num_params / 1e9:.2f} B parameters"
    if spec.quant is None:
        return (
            f"{head}, {_gib(memory.num_params * checkpoint_itemsize)} in the checkpoint; {resident}"
        )
    quant, rest = spec.quant, memory.num_params - memory.num_fp8_params
    kind = f"block {quant.block[0]} × {quant.block[1]}" if quant.block else quant.strategy
    shipped = (
        f"{head}; as shipped (quant_method {quant.method}, {kind}): "
        f"{memory.num_fp8_params / 1e9:.2f} B FP8 = {_gib(memory.num_fp8_params)} + "
        f"scales {_gib(memory.scale_bytes)} + "
        f"{rest / 1e9:.2f} B others = {_gib(rest * checkpoint_itemsize)}, in all "
        f"{_gib(memory.checkpoint_bytes(checkpoint_itemsize))}"
    )
    if not gemm_block(quant):
        return (
            f"{shipped}; {resident}, dequantized at load (the block-scaled FP8 GEMM takes "
            f"128 × 128 blocks only)"
        )
    gemm = (
        f"{_gib(memory.local_gemm_bytes(itemsize))} with the block-scaled FP8 GEMM "
        f"({memory.local_kept_params / 1e9:.2f} B parameters kept in FP8, the rest in {dtype})"
    )
    refused = misaligned_split(spec, tp_size)
    if refused is not None:
        gemm = f"the block-scaled FP8 GEMM refuses TP {tp_size} at load: {refused}"
    if device == "cpu":
        return f"{shipped}; {resident}, dequantized at load (on a CPU; on a Hopper GPU {gemm})"
    return (
        f"{shipped}; resident per rank (TP {tp_size}) on CUDA: {gemm}; where the GEMM is "
        f"not selected (not compute capability 9.x, or torch without blockwise scaled_mm) "
        f"dequantized at load in {dtype}: {_gib(dense_bytes)}"
    )


def misaligned_split(spec: ModelSpec, tp_size: int) -> str | None:
    """Why the block-scaled GEMM refuses ``tp_size`` (a split FP8 matrix it would keep whose
    rank share is not whole 128-blocks: the loader's ``placement.check_cuts``), else None."""
    if not gemm_block(spec.quant) or tp_size == 1 or spec.linear is not None:
        return None
    for matrix in model_matrices(spec):
        if matrix.split is None or not matrix.is_linear or matrix.dense_use:
            continue
        size = (matrix.rows, matrix.columns)[matrix.split]
        share = max(-(-size // tp_size), matrix.min_share)
        if share % GEMM_BLOCK[matrix.split]:
            what = "rows" if matrix.split == 0 else "columns"
            return (
                f"a {matrix.rows} × {matrix.columns} matrix leaves {share} {what} a rank, not "
                f"whole 128-blocks (a TP size that splits on block boundaries is served)"
            )
    return None


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def weight_memory(spec: ModelSpec, tp_size: int = 1) -> WeightMemory | None:
    if spec.linear is not None:
        return None
    matrices = model_matrices(spec)
    fp8 = [m for m in matrices if m.is_linear] if spec.quant is not None else []
    kept = [m for m in fp8 if m.kept_by_gemm(tp_size)] if gemm_block(spec.quant) else []
    return WeightMemory(
        num_params=sum(m.num_params for m in matrices),
        num_fp8_params=sum(m.num_params for m in fp8),
        scale_bytes=sum(4 * _num_scales(spec.quant, m, 1) for m in fp8),
        local_params=sum(m.local_params(tp_size) for m in matrices),
        local_fp8_params=sum(m.local_params(tp_size) for m in fp8),
        local_scale_bytes=sum(4 * _num_scales(spec.quant, m, tp_size) for m in fp8),
        local_kept_params=sum(m.local_params(tp_size) for m in kept),
        local_kept_scale_bytes=sum(4 * _num_scales(spec.quant, m, tp_size) for m in kept),
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
        kv_matrix = Matrix(kv, hidden, 2 * n, 0, min_share=spec.head_dim)
        return [Matrix(q, hidden, n, 0), kv_matrix, Matrix(hidden, q, n, 1)]
    out = [
        Matrix(mla.latent_dim, hidden, n),  # kv_a_proj_with_mqa: replicated
        Matrix(
            heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, n, 0, dense_use=True
        ),  # kv_b: dequantized for the attention backends
        Matrix(hidden, heads * mla.v_head_dim, n, 1),
        Matrix(1, mla.kv_lora_rank + (mla.q_lora_rank or 0), n, is_linear=False),  # a norms
    ]
    if mla.q_lora_rank is None:
        return [*out, Matrix(heads * mla.qk_head_dim, hidden, n, 0)]
    return [*out, Matrix(mla.q_lora_rank, hidden, n), Matrix(heads * mla.qk_head_dim,
                                                             mla.q_lora_rank, n, 0)]  # fmt: skip
