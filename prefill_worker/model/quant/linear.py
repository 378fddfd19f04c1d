"""The model's one linear-layer call, whatever its weight is: a dense matrix (``F.linear``)
or an FP8 weight kept as shipped (``block_gemm.Fp8BlockWeight``: its block-scaled GEMM), and
the loader's fusions over both (q/k/v and gate/up concatenated by rows, experts stacked).

Every projection of the Llama family, MLA (but ``kv_b``: the attention backends take it
dense), the dense and MoE MLPs (each expert's GEMMs, one call per expert) and the MTP
draft's ``eh_proj`` goes through ``linear``/``linear_into``; on the dequantizing path their
weights are plain tensors and these are exactly ``F.linear`` and ``torch.mm(out=)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefill_worker.model.quant.block_gemm import Fp8BlockWeight

Weight = torch.Tensor | Fp8BlockWeight
"""A linear layer's weight ``[out, in]`` (stacked experts: ``[E, out, in]``)."""


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in] @ wᵀ + bias`` -> ``[..., out]`` in ``x``'s dtype."""
    if not isinstance(w, Fp8BlockWeight):
        return F.linear(x, w, bias)
    out = w.linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], w.shape[0])
    return out if bias is None else out.add_(bias)


def linear_into(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out [M, out] = x [M, in] @ wᵀ + bias``, written into ``out``."""
    if isinstance(w, Fp8BlockWeight):
        out.copy_(w.linear(x))
        if bias is not None:
            out.add_(bias)
    elif bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias, x, w.t(), out=out)


def cat_rows(pieces: Sequence[Weight]) -> Weight:
    """The pieces' rows, in order, as one weight: FP8 if every piece is (each is whole
    128-row blocks: the loader keeps no other in FP8), else dense in the first dense piece's
    dtype (an FP8 piece dequantized)."""
    if all(isinstance(p, Fp8BlockWeight) for p in pieces):
        fp8 = [p for p in pieces if isinstance(p, Fp8BlockWeight)]
        kernel = fp8[0].kernel
        weight = _as_fp8(torch.cat([_bytes(p) for p in fp8]))
        return Fp8BlockWeight(weight, torch.cat([p.scale_inv for p in fp8]), kernel)
    return torch.cat(_dense(pieces))


def stack(pieces: Sequence[Weight]) -> Weight:
    """The experts' weights as one ``[E, out, in]`` stack (FP8 if every expert's is)."""
    if all(isinstance(p, Fp8BlockWeight) for p in pieces):
        fp8 = [p for p in pieces if isinstance(p, Fp8BlockWeight)]
        kernel = fp8[0].kernel
        weight = _as_fp8(torch.stack([_bytes(p) for p in fp8]))
        return Fp8BlockWeight(weight, torch.stack([p.scale_inv for p in fp8]), kernel)
    return torch.stack(_dense(pieces))


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a plain matrix (an FP8 one dequantized to ``dtype``)."""
    return w.dequantized(dtype) if isinstance(w, Fp8BlockWeight) else w


def _bytes(w: Fp8BlockWeight) -> torch.Tensor:
    """The e4m3 values as bytes: cat and stack of uint8 run on every device and torch."""
    return w.weight.view(torch.uint8)


def _as_fp8(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.float8_e4m3fn)


def _dense(pieces: Sequence[Weight]) -> list[torch.Tensor]:
    dtype = next(p.dtype for p in pieces if isinstance(p, torch.Tensor))
    device = next(p.device for p in pieces if isinstance(p, torch.Tensor))
    return [dense(p, dtype).to(device) for p in pieces]
