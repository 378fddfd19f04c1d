"""The vLLM versions this worker speaks to, one row each: what each one's compatibility hash
covers and which ``NixlAgentMetadata`` it decodes. Everything version-specific in the vLLM
face is read from a profile here; nothing else names a vLLM version.

    version   connector  metadata a decode of that version needs
    0.33.0    15         v15 fields; ``region_members`` may stay empty (one region per layer,
                         paired by position)
    0.34.0    16         v16: ``layer_group_ids`` added, and ``region_members`` must name
                         each region's layers: a 0.34 decode pairs regions by the layers both
                         sides hold (``base_worker._pair_regions``) and raises when the list's
                         length differs from the regions' or a layer has no counterpart

Both hash the same factors (``handshake.compat_hash``) with their own ``vllm_version`` and
``nixl_connector_version``, so a decode of one version refuses a payload built for the
other: each version is served on a side channel of its own (``channel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class NixlAgentMetadataV15(msgspec.Struct):
    """vLLM 0.33's ``NixlAgentMetadata``: same field names, same order, same defaults, so
    that msgspec writes the bytes vLLM's own encoder writes. One region per layer
    (``kv_caches_base_addr``, ``block_lens``, ``block_strides``, ``region_*`` in step)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class NixlAgentMetadataV16(msgspec.Struct):
    """vLLM 0.34's ``NixlAgentMetadata``: v15's fields with ``layer_group_ids`` (the KV-cache
    group of each layer in ``region_members``) before ``packed_member_layouts``."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    layer_group_ids: dict[str, int] = msgspec.field(default_factory=dict)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


NixlAgentMetadata = NixlAgentMetadataV15 | NixlAgentMetadataV16


@dataclass(frozen=True, slots=True)
class VllmProfile:
    """One vLLM version as its NIXL connector sees a prefill."""

    version: str  # vLLM's ``__version__``: hashed
    connector_version: int  # its ``NIXL_CONNECTOR_VERSION``: hashed
    names_region_layers: bool  # advertise ``region_members`` and ``layer_group_ids`` (v16)
    # serves a sliding-window model's KV-cache groups (``groups``; proven against its decode)
    serves_kv_groups: bool = False


PROFILES: dict[str, VllmProfile] = {
    p.version: p
    for p in (
        VllmProfile("0.33.0", 15, names_region_layers=False),
        VllmProfile("0.34.0", 16, names_region_layers=True, serves_kv_groups=True),
    )
}
DEFAULT_VERSIONS = ("0.33.0", "0.34.0")  # served unless configured otherwise; the first is
# the one a request that names no version gets


PULL, PUSH = "pull", "push"  # vLLM's transfer modes (its hash covers the mode)
TRANSFER_MODES = (PULL, PUSH)


# A vLLM decode's ``kv_cache_dtype`` (``--kv-cache-dtype``) -> the pool it holds, as this
# worker's ``kv.layout`` names a pool dtype. Both FP8 names make vLLM's float8_e4m3fn cache
# (its ``reshape_and_cache`` writes ``k / k_scale`` converted round-to-nearest, saturating at
# +-448): the worker's ``fp8_e4m3`` pool, byte for byte. "auto" is the model's dtype. vLLM
# hashes the string itself (``cache_dtype`` in ``handshake.compat_hash``), so "fp8" and
# "fp8_e4m3" decodes do not pair with each other: the worker hashes the one its decodes run.
FP8_POOL = "fp8_e4m3"
CACHE_DTYPES: dict[str, str | None] = {"auto": None, "fp8": FP8_POOL, "fp8_e4m3": FP8_POOL}


def cache_dtype_refusal(cache_dtype: str, pool_dtype: str, model_dtype: str) -> str | None:
    """None when decodes running ``kv_cache_dtype`` ``cache_dtype`` read a pool of
    ``pool_dtype`` (for a model of ``model_dtype``) as their own; else why they cannot."""
    if cache_dtype not in CACHE_DTYPES:
        return f"vLLM kv_cache_dtype {cache_dtype!r}: served are {', '.join(CACHE_DTYPES)}"
    holds = CACHE_DTYPES[cache_dtype] or model_dtype
    if holds == pool_dtype:
        return None
    return (
        f"vLLM decodes with kv_cache_dtype {cache_dtype!r} hold a {holds} cache; this worker's "
        f"KV pool is {pool_dtype}: their blocks would read our bytes as another dtype"
    )


def channel_key(version: str, mode: str = PULL) -> str:
    """The name of the side channel a decode of ``version`` in ``mode`` handshakes with: the
    version for a pull (as before push was served), ``<version>+push`` for a push."""
    return version if mode == PULL else f"{version}+{mode}"


def why_unserved(version: str, served: tuple[str, ...]) -> str | None:
    """None when ``version`` is one of ``served``; else why a request naming it is refused."""
    if version in served:
        return None
    known = "" if version in PROFILES else " (no profile for that version)"
    return f"vLLM {version}{known}: this worker serves vLLM {', '.join(served)}"


@dataclass(frozen=True, slots=True)
class LayerRegion:
    """One registered layer, vLLM's LBHNC: ``[num_blocks, kv_heads, block_size, 2*head_dim]``,
    K‖V per (head, token); block ``b`` at ``base_addr + b * block_bytes``."""

    name: str
    base_addr: int
    block_bytes: int
    group: int = 0  # the layer's KV-cache group (``groups``)


def agent_metadata(
    profile: VllmProfile,
    engine_id: str,
    agent_blob: bytes,
    layers: list[LayerRegion],
    num_blocks: int,
    block_size: int,
    attn_backend_name: str,
    mem_type: str = "DRAM",
    ssm_sizes: tuple[int, int] = (0, 0),
) -> NixlAgentMetadata:
    """The metadata of one TP rank whose layers are contiguous LBHNC regions (no mamba, no
    PLE, no packed members; each layer in its ``group``: 0 unless a sliding-window model's),
    as a vLLM worker of ``profile``'s version writes it for itself."""
    fields: dict[str, Any] = {
        "engine_id": engine_id,
        "agent_metadata": agent_blob,
        "kv_caches_base_addr": [layer.base_addr for layer in layers],
        "device_id": 0,
        "num_blocks": num_blocks,
        "block_lens": [layer.block_bytes for layer in layers],
        "block_strides": [layer.block_bytes for layer in layers],
        "kv_cache_layout": "LBHNC",
        "block_size": block_size,
        "ssm_sizes": ssm_sizes,  # a hybrid's linear layers: (conv, recurrent) bytes
        "attn_backend_name": attn_backend_name,
        "physical_blocks_per_logical_kv_block": 1,
        "region_num_blocks": [num_blocks] * len(layers),
        "region_group_ids": [layer.group for layer in layers],
        "region_names": [layer.name for layer in layers],
        "region_mem_types": [mem_type] * len(layers),
    }
    if not profile.names_region_layers:
        return NixlAgentMetadataV15(**fields)
    return NixlAgentMetadataV16(
        **fields,
        region_members=[[layer.name] for layer in layers],
        layer_group_ids={layer.name: layer.group for layer in layers},
    )
