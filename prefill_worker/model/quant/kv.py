"""An FP8 KV cache (``cache.kv_dtype: fp8_e4m3``): the pool holds float8_e4m3fn, one byte per
value, half of bf16, so a transfer moves half the bytes per token.

The rule that makes a value into a pool byte is the decode's, because the decode reads the
pages as its own: SGLang's ``set_kv_buffer`` (and its MLA pool's) casts ``k / k_scale`` to
``torch.float8_e4m3fn``, with no scale (1.0) unless a checkpoint ships ``k_scale``; vLLM's
``reshape_and_cache`` divides by ``k_scale`` (1.0 by default) and converts round-to-nearest,
saturating at ±448. With scale 1.0 both are torch's cast (round to nearest even, saturating
on this torch): ``to_pool``. Attention reads the bytes back (``from_pool``): a chunk from
position 0 attends over its fresh K/V in the model's dtype, as SGLang's ragged prefill does;
a later chunk or a prefix hit over the FP8 pages, upcast.

Only the torch SDPA backends read FP8 pages back (on CPU and CUDA); FlashInfer is refused
with the reason. Checkpoint-shipped ``k_scale``/``v_scale`` (``kv_scales``) divide on the
way in and multiply on the way out; without them the scale is 1.0.
Torch-free to import (``check-config`` uses the names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUTO, FP8_E4M3 = "auto", "fp8_e4m3"
UNSCALED = (1.0, 1.0)  # a layer's (K, V) scales when the checkpoint ships none
KV_DTYPES = (AUTO, FP8_E4M3)


def kv_dtype_name(kv_dtype: str, model_dtype: str) -> str:
    """The pool's dtype name (a key of ``kv.layout.DTYPE_ITEMSIZE``): the model's, or FP8."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"cache.kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return model_dtype if kv_dtype == AUTO else FP8_E4M3


# Backends a model family picks for itself (``model.attention_backend`` does not change
# them): DSA's sparse attention, gpt-oss's sinks. Neither reads an FP8 pool.
FAMILY_BACKENDS = frozenset({"sdpa_dsa", "sinks"})


def check_kv_backend(pool_dtype: str, attention_backend: str) -> None:
    """``ValueError`` when the attention backend cannot read the pool's dtype back."""
    if pool_dtype == FP8_E4M3 and attention_backend in FAMILY_BACKENDS:
        raise ValueError(
            f"cache.kv_dtype fp8_e4m3 is not served for this model: its attention "
            f"({attention_backend!r}, chosen by the model family whatever "
            "model.attention_backend says) reads the pool in the model's dtype only: set "
            "cache.kv_dtype auto"
        )
    if pool_dtype == FP8_E4M3 and attention_backend != "sdpa":
        raise ValueError(
            f"cache.kv_dtype fp8_e4m3 is read back by the sdpa attention backend only, not "
            f"{attention_backend!r}: set model.attention_backend sdpa"
        )


def to_pool(values: torch.Tensor, pool: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``values`` as the pool stores them (scale 1.0: the cast; a no-op for an unquantized
    pool of the model's dtype). A checkpoint's ``scale`` (``kv_scales``): ``value / scale``
    in float32, then the cast, as vLLM's cache kernel converts (one rounding; SGLang divides
    in the model's dtype first, the same bytes for a float32 model)."""
    if scale == 1.0:
        return values.to(pool.dtype)
    return (values.float() / scale).to(pool.dtype)


def from_pool(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Pool values read back for attention in the model's ``dtype`` (times ``scale``)."""
    if scale == 1.0:
        return values.to(dtype)
    return (values.float() * scale).to(dtype)
