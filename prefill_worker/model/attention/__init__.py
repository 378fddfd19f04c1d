"""Attention backends behind one lazy registry: ``sdpa``, ``flashinfer``, and ``auto``.

``model.attention_backend`` names one for every family. A dense model gets ``BACKENDS``'
(K/V pools); an MLA model gets ``MLA_BACKENDS``' of the same name (its latent pool), and
``flashinfer`` only where its MLA kernels apply (``resolve_mla_backend_name``): elsewhere, and
always on the CPU, the torch one.

A backend is planned once per batch (``plan``) and then called once per layer (``attend``)
after the layer's fresh K/V were written into the pool. Backends are imported only when
chosen, so flashinfer (CUDA only) is never imported on a CPU host. The batch and the
backend Protocol are in ``base.py`` (re-exported here), which the backends import.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from prefill_worker.model.attention.base import (
    AttentionBackend,
    AttentionBatch,
    BackendFactory,
    ChunkSpan,
    MLAAttentionBackend,
    MLABackendFactory,
)
from prefill_worker.model.attention.mla_plan import kernel_mismatch

if TYPE_CHECKING:
    from prefill_worker.model.hf_config import MLASpec

__all__ = [
    "BACKENDS",
    "MLA_BACKENDS",
    "AttentionBackend",
    "AttentionBatch",
    "BackendFactory",
    "ChunkSpan",
    "MLAAttentionBackend",
    "create_backend",
    "create_mla_backend",
    "has_flashinfer",
    "resolve_backend_name",
    "resolve_mla_backend_name",
]

log = logging.getLogger(__name__)


def _sdpa(device: torch.device) -> AttentionBackend:
    from prefill_worker.model.attention.sdpa import SdpaBackend

    return SdpaBackend(device)


def _flashinfer(device: torch.device) -> AttentionBackend:
    from prefill_worker.model.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(device)


def _sdpa_mla(device: torch.device) -> MLAAttentionBackend:
    from prefill_worker.model.attention.sdpa_mla import MLASdpaBackend

    return MLASdpaBackend(device)


def _flashinfer_mla(device: torch.device) -> MLAAttentionBackend:
    from prefill_worker.model.attention.flashinfer_mla import FlashInferMLABackend

    return FlashInferMLABackend.create(device)


BACKENDS: dict[str, BackendFactory] = {"sdpa": _sdpa, "flashinfer": _flashinfer}
MLA_BACKENDS: dict[str, MLABackendFactory] = {"sdpa": _sdpa_mla, "flashinfer": _flashinfer_mla}


def has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` -> ``flashinfer`` on CUDA when importable, else ``sdpa``; checks the choice."""
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and has_flashinfer() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: auto, {', '.join(BACKENDS)})")
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("attention backend 'flashinfer' needs a CUDA device")
    if name == "flashinfer" and not has_flashinfer():
        raise ValueError("attention backend 'flashinfer' is not installed (pip install .[cuda])")
    return name


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    return BACKENDS[resolve_backend_name(name, device)](device)


def resolve_mla_backend_name(name: str, mla: MLASpec, dtype: torch.dtype) -> str:
    """An MLA model's backend from ``name`` as ``resolve_backend_name`` returned it:
    ``flashinfer`` stays only where its MLA kernels apply (``mla_plan.kernel_mismatch``);
    otherwise ``sdpa``, with a warning that says why."""
    if name != "flashinfer":
        return name
    dims = (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim)
    reason = kernel_mismatch(dims, str(dtype).removeprefix("torch."))
    if reason is None:
        return name
    log.warning(
        "attention backend flashinfer: its MLA kernels do not apply (%s); torch SDPA", reason
    )
    return "sdpa"


def create_mla_backend(
    name: str, device: torch.device, mla: MLASpec, dtype: torch.dtype
) -> MLAAttentionBackend:
    """An MLA model's backend for ``name`` (``auto`` too), resolved as above."""
    resolved = resolve_mla_backend_name(resolve_backend_name(name, device), mla, dtype)
    return MLA_BACKENDS[resolved](device)
