"""vLLM's push mode, the link: a decode engine's ranks handshaken, checked and loaded on our
agent before the first WRITE to it.

What vLLM's prefill does before it WRITEs to a decode: it asks the decode's side channel
(``decode_host``, ``decode_port``, the registration's) for ``get_meta_msg`` of every rank
it writes to (pp rank 0, tp ranks ``0 .. decode_tp_size - 1``, one REQ socket, one query
after the other), checks each answer's compatibility hash against its own for that version
in push mode, and loads each rank's ``NixlAgentMetadata`` (LBHNC, our block size, one region
per layer, one KV-cache group). A decode of TP ``d`` holds ``kv_heads / d`` heads per rank
(vLLM's heterogeneous TP): rank ``r``'s block of a layer is heads ``r * kv_heads / d`` up to
the next rank's, of every token, which in our LBHNC staging block
``[kv_heads, block_size, 2 * head_dim]`` is the contiguous ``r``-th ``1/d`` of the block. So
its blocks are ``block_bytes / d`` long, and our side of a WRITE to it is one descriptor per
block per layer of that slice (``local_slices``). A ``d`` that does not divide our KV heads
is refused (vLLM's own prefill would replicate heads across decode ranks; this worker does
not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.vllm.handshake import GET_META_MSG, HandshakePayload
from prefill_worker.transfer.vllm.profiles import (
    PROFILES,
    NixlAgentMetadata,
    NixlAgentMetadataV15,
    NixlAgentMetadataV16,
)
from prefill_worker.transfer.vllm.push import Registration
from prefill_worker.transfer.vllm.staging import StagingLayout

HANDSHAKE_TIMEOUT_MS = 5000  # vLLM's own receive timeout on a side channel


class LinkRefused(Exception):
    """A decode this worker will not write to, with the reason."""


@dataclass(slots=True)
class DecodeLink:
    """A decode's ranks loaded on ours, each rank's blocks prepared: in ``remotes[r]`` block
    ``b`` of layer ``l`` is entry ``l * num_blocks + b``. ``local``: our side's head slices
    for a decode of TP > 1 (``local_slices``; None at TP 1: the whole blocks)."""

    agent_names: tuple[str, ...]
    remotes: tuple[Any, ...]  # nixl prepped descriptor lists, one per rank
    num_blocks: int
    local: Any = None

    @property
    def tp_size(self) -> int:
        return len(self.remotes)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def tp_refusal(decode_tp_size: int, num_kv_heads: int) -> str | None:
    """Why a decode of ``decode_tp_size`` ranks cannot get our heads, or None."""
    if decode_tp_size < 1 or num_kv_heads % decode_tp_size:
        return f"a decode of TP {decode_tp_size} for our {num_kv_heads} KV heads"
    return None


def fetch_payloads(
    host: str, port: int, num_ranks: int = 1, timeout_ms: int = HANDSHAKE_TIMEOUT_MS
) -> list[bytes]:
    """The first frame of a decode's side channel's answer to ``get_meta_msg`` for each of
    tp ranks ``0 .. num_ranks - 1`` (pp rank 0), as vLLM asks: one socket, in turn."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
    payloads = []
    try:
        sock.connect(f"tcp://{host}:{port}")
        for rank in range(num_ranks):
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, rank)))
            parts = sock.recv_multipart()
            if len(parts) != 2:
                raise LinkRefused(f"handshake answer (rank {rank}) of {len(parts)} frames, not 2")
            payloads.append(parts[0])
    except zmq.ZMQError as exc:
        raise LinkRefused(f"handshake with {host}:{port} failed: {exc}") from None
    finally:
        sock.close(linger=0)
    return payloads


def fetch_payload(host: str, port: int, timeout_ms: int = HANDSHAKE_TIMEOUT_MS) -> bytes:
    """``fetch_payloads`` of rank 0 alone."""
    return fetch_payloads(host, port, 1, timeout_ms)[0]


def check_metadata(
    payload: bytes,
    expected_hash: str,
    version: str,
    engine_id: str,
    layout: StagingLayout,
    decode_tp_size: int = 1,
) -> NixlAgentMetadata:
    """One decode rank's metadata, once its hash is ours and its blocks are our blocks' head
    slice for a decode of ``decode_tp_size`` in shape."""
    try:
        answer = msgspec.msgpack.decode(payload, type=HandshakePayload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LinkRefused(f"not vLLM's handshake payload: {exc}") from None
    if answer.compatibility_hash != expected_hash:
        raise LinkRefused(
            f"compatibility hash mismatch: the decode's {answer.compatibility_hash[:16]}, "
            f"ours for vLLM {version} push {expected_hash[:16]} (another vLLM version, model, "
            "dtype, attention backend, or a decode in pull mode)"
        )
    kind: type[NixlAgentMetadata] = NixlAgentMetadataV15
    if PROFILES[version].names_region_layers:
        kind = NixlAgentMetadataV16
    try:
        meta: NixlAgentMetadata = msgspec.msgpack.decode(answer.agent_metadata_bytes, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LinkRefused(f"not vLLM {version}'s agent metadata: {exc}") from None
    lay = layout
    block_bytes = lay.block_bytes // decode_tp_size
    why = None
    if meta.engine_id != engine_id:
        why = f"engine id {meta.engine_id!r}, registered as {engine_id!r}"
    elif meta.kv_cache_layout != "LBHNC" or meta.block_size != lay.block_size:
        why = f"layout {meta.kv_cache_layout} block {meta.block_size}, ours LBHNC {lay.block_size}"
    elif meta.physical_blocks_per_logical_kv_block != 1:
        why = f"{meta.physical_blocks_per_logical_kv_block} kernel blocks per block"
    elif len(meta.kv_caches_base_addr) != lay.num_layers:
        why = f"{len(meta.kv_caches_base_addr)} regions for our {lay.num_layers} layers"
    elif set(meta.block_lens) != {block_bytes} or len(meta.block_strides) != lay.num_layers:
        why = f"blocks of {sorted(set(meta.block_lens))} bytes, ours {block_bytes}"
        if decode_tp_size > 1:
            why += f" (1/{decode_tp_size} of a block: a rank's heads)"
    elif meta.num_blocks < 1:
        why = "no blocks"
    if why is not None:
        raise LinkRefused(f"the decode's KV cache is not ours in shape: {why}")
    return meta


def local_slices(region_base_addrs: Sequence[int], layout: StagingLayout, tp: int) -> np.ndarray:
    """Our staging blocks cut in ``tp`` head slices, as (addr, len, 0) rows: rank ``r``'s
    slice of block ``b`` of layer ``l`` is row ``(r * num_layers + l) * num_blocks + b``."""
    lay = layout
    piece = lay.block_bytes // tp
    ranks = np.arange(tp, dtype=np.uint64)[:, None, None] * np.uint64(piece)
    bases = np.asarray(region_base_addrs, dtype=np.uint64)[None, :, None]
    blocks = np.arange(lay.num_blocks, dtype=np.uint64)[None, None, :] * np.uint64(lay.block_bytes)
    rows = np.zeros((tp * lay.num_layers * lay.num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = (ranks + bases + blocks).ravel()
    rows[:, 1] = piece
    return rows


def link_decode(
    agent: Any,
    region_base_addrs: Sequence[int],
    layout: StagingLayout,
    expected_hash: str,
    reg: Registration,
    version: str,
    run: Callable[..., Any] = _call,
) -> DecodeLink:
    """The decode's every rank handshaken and checked on the caller's thread (the pusher's
    link thread), then loaded on ``agent`` through ``run`` (where the agent lives: the push
    side's transfer thread, ``PushThread.run``). ``LinkRefused`` with the reason, nothing
    left loaded."""
    tp = reg.decode_tp_size
    why = tp_refusal(tp, layout.num_kv_heads)
    if why is not None:
        raise LinkRefused(why)
    payloads = fetch_payloads(reg.decode_host, reg.decode_port, tp)
    metas = [
        check_metadata(p, expected_hash, version, reg.decode_engine_id, layout, tp)
        for p in payloads
    ]
    link: DecodeLink = run(_load, agent, metas, region_base_addrs, layout, tp)
    return link


def _load(
    agent: Any,
    metas: Sequence[NixlAgentMetadata],
    region_base_addrs: Sequence[int],
    layout: StagingLayout,
    tp: int,
) -> DecodeLink:
    """The checked ranks' agents loaded and blocks prepared on ``agent``; ``LinkRefused``
    with nothing left loaded."""
    num_blocks = min(m.num_blocks for m in metas)
    names: list[str] = []
    remotes: list[Any] = []
    try:
        for meta in metas:
            names.append(agent.add_remote_agent(meta.agent_metadata))
            mem = (meta.region_mem_types or ["DRAM"])[0]
            rows = [
                (base + b * stride, length, meta.device_id)
                for base, stride, length in zip(
                    meta.kv_caches_base_addr, meta.block_strides, meta.block_lens, strict=True
                )
                for b in range(num_blocks)
            ]
            remotes.append(agent.prep_xfer_dlist(names[-1], np.array(rows, np.uint64), mem))
        local = None
        if tp > 1:
            table = local_slices(region_base_addrs, layout, tp)
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, "DRAM")
    except NIXL_ERRORS as exc:
        forget(agent, DecodeLink(tuple(names), tuple(remotes), num_blocks))
        raise LinkRefused(f"its agent or blocks did not load: {exc}") from None
    return DecodeLink(tuple(names), tuple(remotes), num_blocks, local)


def forget(agent: Any, link: DecodeLink) -> None:
    """Its lists released and agents removed (what loaded of them); NIXL's errors raised."""
    for remote in link.remotes:
        remote.release()
    if link.local is not None:
        link.local.release()
    for name in link.agent_names:
        agent.remove_remote_agent(name)
