"""SGLang's PD control frames (decode → prefill on the PULL socket, and the replies), parsed
into typed messages or refused with a ``FrameError`` naming the frame at fault.

Read from SGLang's own decode code (``srt/disaggregation/nixl/conn.py`` and ``common/conn.py``,
0.5.20-0.5.23). Integers travel as ASCII decimal; pointer lists as packed unsigned 64-bit (Q),
page ids as packed int32, both little-endian (the host's order on x86 and ARM). Frame 0 is a tag::

    registration  [b"NixlMsgGuard", b"None", ip, port, agent_name, agent_metadata,
                   kv_ptrs (Q: K of every layer, then V), aux_ptrs (Q), state_ptrs, gpu_id,
                   tp_size, tp_rank, kv_item_len, state_item_lens, state_dims, staging_ptr,
                   staging_size, num_slots, mem_kinds ("DRAM,DRAM,..."), kv_item_lens (Q),
                   state_layer_ids, kv_layer_ids, dcp_size, dcp_rank, state_data_lens]
                  24 frames up to 0.5.22, 25 from 0.5.23 (the last one added); the state
                  fields are packed lists per component (``state_frames``)
    request       [b"NixlMsgGuard", room, ip, port, agent_name, page_ids (int32), aux_index,
                   required_dst_info_num, state_indices, decode_prefix_len, is_dummy]
    abort         [b"ABORT", room, ip, port(, generation)]
    replies       [b"KV_STATUS", room, b"4" (success) | b"0" (failed), prefill_rank, reason]
                  [b"ABORT_ACK", room, prefill_rank(, generation)]   to the ``ip:port`` named

Torch-, ZMQ- and NIXL-free; what the worker accepts beyond well-formed frames is ``accept``'s.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prefill_worker.transfer import wire
from prefill_worker.transfer.sglang.state_frames import (
    StateBuffers,
    StateFrameError,
    registration_state,
    request_state,
)

GUARD = b"NixlMsgGuard"
ABORT_TAG = b"ABORT"
ABORT_ACK_TAG = b"ABORT_ACK"
KV_STATUS_TAG = b"KV_STATUS"
KV_SUCCESS, KV_FAILED = 4, 0  # SGLang's KVPoll.Success and KVPoll.Failed
PREFILL_RANK = 0  # the leader; CP and PP are 1 here
NUM_REGISTRATION_FRAMES = (24, 25)  # 0.5.20-0.5.22, 0.5.23
MAX_FRAMES = max(NUM_REGISTRATION_FRAMES)  # the longest message: more parts are never read
NUM_REQUEST_FRAMES = 11
MAX_ROOM = 2**63  # rooms are 63-bit on both protocols

_INT = re.compile(rb"-?[0-9]{1,20}")
_MAX_AGENT_NAME = 255
_NIXL_MD_MAGIC = b"nixlSerDes|Agent"
T = TypeVar("T")
S = TypeVar("S")


class FrameError(ValueError):
    """A control message that cannot be read; the text names the frame and why."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A decode's control socket (its PULL), where replies go."""

    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Registration:
    """A decode rank's KV and metadata buffers, once per decode rank (its "peer")."""

    endpoint: Endpoint
    agent_name: str
    agent_metadata: bytes
    kv_ptrs: tuple[int, ...]  # K of layers 0..L-1, then V of layers 0..L-1
    aux_ptrs: tuple[int, ...]  # the decode's MetadataBuffers, in its order
    gpu_id: int
    tp_size: int
    tp_rank: int
    kv_item_len: int  # bytes of one page of one region
    num_slots: int  # pages in each region (page 0 is SGLang's padding page)
    mem_kinds: tuple[str, ...]  # per region: "DRAM" or "VRAM"
    kv_item_lens: tuple[int, ...]  # per region
    kv_layer_ids: tuple[int, ...]  # empty for plain MHA pools
    dcp_size: int
    has_state: bool  # state buffers (Mamba, SWA, DSA) registered
    has_staging: bool  # a staging buffer for heterogeneous TP
    state: tuple[StateBuffers, ...] = ()  # its state components, in its own order


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """Per request: where this room's KV and first token go (a ``want``)."""

    room: int
    endpoint: Endpoint
    agent_name: str
    packed_page_ids: bytes  # int32, for prompt pages decode_prefix_len / page_size onward
    aux_index: int
    required_dst_info_num: int  # decode ranks that each send this frame for the room
    has_state: bool
    decode_prefix_len: int  # prompt tokens the decode already holds
    is_dummy: bool
    state_indices: tuple[tuple[int, ...], ...] = ()  # per state component, the decode's items

    def want(self) -> wire.Want:
        return wire.Want(self.room, self.packed_page_ids, self.aux_index, self.decode_prefix_len)


@dataclass(frozen=True, slots=True)
class AbortNotice:
    """The decode gave up a room; ``generation`` (0.5.22+) is echoed in the ABORT_ACK."""

    room: int
    endpoint: Endpoint
    generation: int | None


Message = Registration | TransferRequest | AbortNotice


def parse(frames: list[bytes]) -> Message:
    """One control message, or ``FrameError``."""
    if not frames:
        raise FrameError("an empty message")
    if frames[0] == ABORT_TAG:
        return _abort(frames)
    if frames[0] != GUARD:
        raise FrameError(f"frame 0 is {frames[0][:20]!r}, not a known tag")
    if len(frames) > 1 and frames[1] == b"None":
        return _registration(frames)
    return _request(frames)


def kv_status(
    room: int, is_ok: bool, reason: str | None, prefill_rank: int = PREFILL_RANK
) -> list[bytes]:
    status = KV_SUCCESS if is_ok else KV_FAILED
    return [
        KV_STATUS_TAG,
        b"%d" % room,
        b"%d" % status,
        b"%d" % prefill_rank,
        (reason or "").encode("utf-8", "replace"),
    ]


def abort_ack(room: int, generation: int | None, prefill_rank: int = PREFILL_RANK) -> list[bytes]:
    ack = [ABORT_ACK_TAG, b"%d" % room, b"%d" % prefill_rank]
    return ack if generation is None else [*ack, b"%d" % generation]


def check_nixl_metadata(metadata: bytes, agent_name: str, max_bytes: int) -> str | None:
    """Why these bytes are not the NIXL agent metadata of ``agent_name``, or None. SGLang
    sends the blob bare (no checksum); its header names the agent, which is checked here
    before NIXL parses a byte: ``nixlSerDes|Agent`` + uint64 length + the name + ``|``."""
    if len(metadata) > max_bytes:
        return f"agent metadata of {len(metadata)} bytes exceeds {max_bytes}"
    name = agent_name.encode()
    head = len(_NIXL_MD_MAGIC)
    if not metadata.startswith(_NIXL_MD_MAGIC) or len(metadata) < head + 8:
        return "agent metadata is not a NIXL metadata blob"
    (length,) = struct.unpack_from("<Q", metadata, head)
    if length != len(name) or metadata[head + 8 : head + 8 + length + 1] != name + b"|":
        return f"agent metadata does not name agent {agent_name!r}"
    return None


# -- the three messages ---------------------------------------------------------------


def _registration(f: list[bytes]) -> Registration:
    if len(f) not in NUM_REGISTRATION_FRAMES:
        raise FrameError(f"a registration has 24 or 25 frames, this one has {len(f)}")
    kv_ptrs = _u64s(f[6], "kv_ptrs")
    state = _state(registration_state, f)
    return Registration(
        endpoint=_endpoint(f[2], f[3]),
        agent_name=_name(f[4]),
        agent_metadata=f[5],
        kv_ptrs=kv_ptrs,
        aux_ptrs=_u64s(f[7], "aux_ptrs"),
        gpu_id=_int(f[9], "gpu_id", 0),
        tp_size=_int(f[10], "tp_size", 1),
        tp_rank=_int(f[11], "tp_rank", 0),
        kv_item_len=_int(f[12], "kv_item_len", 1),
        num_slots=_int(f[17], "num_slots", 1),
        mem_kinds=tuple(f[18].decode("ascii", "replace").split(",")) if f[18] else (),
        kv_item_lens=_u64s(f[19], "kv_item_lens"),
        kv_layer_ids=_u32s(f[21], "kv_layer_ids"),
        dcp_size=_int(f[22], "dcp_size", 1) if f[22] else 1,
        has_state=bool(state),
        has_staging=bool(f[15] or f[16]),
        state=state,
    )


def _request(f: list[bytes]) -> TransferRequest:
    if len(f) != NUM_REQUEST_FRAMES:
        raise FrameError(f"a transfer request has 11 frames, this one has {len(f)}")
    if len(f[5]) % 4:
        raise FrameError(f"page_ids is not packed int32 ({len(f[5])} bytes)")
    state_indices = _state(request_state, f[8])
    return TransferRequest(
        room=_room(f[1]),
        endpoint=_endpoint(f[2], f[3]),
        agent_name=_name(f[4]),
        packed_page_ids=f[5],
        aux_index=_int(f[6], "aux_index", 0, 2**31 - 1),
        required_dst_info_num=_int(f[7], "required_dst_info_num", 1),
        has_state=any(state_indices),
        decode_prefix_len=_int(f[9], "decode_prefix_len", 0, 2**31 - 1),
        is_dummy=_int(f[10], "is_dummy", 0, 1) == 1,
        state_indices=state_indices,
    )


def _abort(f: list[bytes]) -> AbortNotice:
    if len(f) not in (4, 5):
        raise FrameError(f"an ABORT with a return address has 4 or 5 frames, not {len(f)}")
    generation = _int(f[4], "generation", 0) if len(f) == 5 else None
    return AbortNotice(_room(f[1]), _endpoint(f[2], f[3]), generation)


# -- fields ---------------------------------------------------------------------------


def _int(raw: bytes, what: str, low: int, high: int = 2**64 - 1) -> int:
    if _INT.fullmatch(raw) is None:
        raise FrameError(f"{what} is not a decimal integer: {raw[:24]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise FrameError(f"{what} {value} is outside [{low}, {high}]")
    return value


def _room(raw: bytes) -> int:
    return _int(raw, "room", 0, MAX_ROOM - 1)


def _endpoint(host: bytes, port: bytes) -> Endpoint:
    """An IP address: a host name is refused, never resolved (resolving can block for
    seconds, and where it ran it held up every decode's replies)."""
    text = host.decode("ascii", "replace")
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise FrameError(f"ip {text[:40]!r} is not an IP address") from None
    return Endpoint(text, _int(port, "port", 1, 65535))


def _name(raw: bytes) -> str:
    if not 0 < len(raw) <= _MAX_AGENT_NAME:
        raise FrameError(f"agent_name must be 1..{_MAX_AGENT_NAME} bytes, not {len(raw)}")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("agent_name is not ASCII") from None


def _u64s(raw: bytes, what: str) -> tuple[int, ...]:
    if len(raw) % 8:
        raise FrameError(f"{what} is not packed uint64 ({len(raw)} bytes)")
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def _u32s(raw: bytes, what: str) -> tuple[int, ...]:
    if len(raw) % 4:
        raise FrameError(f"{what} is not packed uint32 ({len(raw)} bytes)")
    return struct.unpack(f"<{len(raw) // 4}I", raw)


def _state(parse_state: Callable[[T], S], raw: T) -> S:
    """A state field (``state_frames``), its error as a ``FrameError``."""
    try:
        return parse_state(raw)
    except StateFrameError as exc:
        raise FrameError(str(exc)) from None
