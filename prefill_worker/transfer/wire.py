"""The bootstrap protocol between a decode node and a worker (DESIGN §5): messages and codec.

Every message is one ZMQ frame: a msgpack map with ``"v": 1`` and ``"type"``. Never pickle.
Page ids travel as packed little-endian int32 bytes. Unknown extra fields are ignored; an
unknown type, a missing field or a wrong type raises ``WireError`` naming the field.

Decode → worker: ``register``, ``want``, ``abort``, ``heartbeat``, ``bye``.
Worker → decode: ``registered``, ``status``, ``heartbeat``, ``reject`` (an undecodable message),
``unknown_peer`` (a message from a connection that is not registered; the SDK registers again).

NIXL agent metadata travels inside ``register`` framed, because a corrupt blob can crash
``add_remote_agent``; the frame is checked before NIXL ever sees the bytes::

    offset  0  4 bytes   magic b"PWMD"
    offset  4  uint8     frame version (1)
    offset  5  3 bytes   zero
    offset  8  uint64    payload length
    offset 16  32 bytes  sha256(payload)
    offset 48  payload
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np

from prefill_worker.kv.layout import DTYPE_ITEMSIZE, KVLayout, KVRegions

WIRE_VERSION = 1
_FRAME_HEAD = struct.Struct("<4sB3sQ32s")
_FRAME_MAGIC = b"PWMD"
_FRAME_VERSION = 1

StatusCode = Literal["ok", "failed", "aborted"]
_STATUS_CODES = ("ok", "failed", "aborted")


class WireError(ValueError):
    """A message or metadata frame that cannot be accepted; the text says why."""


def frame_metadata(payload: bytes) -> bytes:
    head = _FRAME_HEAD.pack(
        _FRAME_MAGIC, _FRAME_VERSION, bytes(3), len(payload), hashlib.sha256(payload).digest()
    )
    return head + payload


def unframe_metadata(frame: bytes) -> bytes:
    """The payload of a metadata frame, or ``WireError`` if it is short, long or corrupt."""
    if len(frame) < _FRAME_HEAD.size:
        raise WireError(
            f"metadata frame truncated: {len(frame)} bytes, header needs {_FRAME_HEAD.size}"
        )
    magic, version, pad, length, digest = _FRAME_HEAD.unpack_from(frame)
    if magic != _FRAME_MAGIC or version != _FRAME_VERSION or pad != bytes(3):
        raise WireError("metadata frame has a bad magic or version")
    payload = frame[_FRAME_HEAD.size :]
    if len(payload) != length:
        raise WireError(f"metadata frame length mismatch: header {length}, got {len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise WireError("metadata frame checksum mismatch")
    return payload


@dataclass(frozen=True, slots=True)
class Register:
    agent_name: str
    metadata: bytes  # framed, see frame_metadata
    regions: KVRegions
    compat_hash: str


@dataclass(frozen=True, slots=True)
class Want:
    """Page ids stay packed (``<i4`` bytes) as they arrived: the worker checks the peer and the
    count before it looks at them, and then only as a zero-copy int32 view."""

    room: int
    packed_dst_page_ids: bytes
    dst_aux_slot: int
    num_cached_tokens: int

    @classmethod
    def of(
        cls, room: int, dst_page_ids: Sequence[int], dst_aux_slot: int, num_cached_tokens: int
    ) -> Want:
        packed = np.asarray(dst_page_ids, dtype="<i4").tobytes()
        return cls(room, packed, dst_aux_slot, num_cached_tokens)

    @property
    def num_dst_pages(self) -> int:
        return len(self.packed_dst_page_ids) // 4

    @property
    def dst_page_ids(self) -> np.ndarray:
        """[num_dst_pages] int32, a read-only view of the packed bytes."""
        return np.frombuffer(self.packed_dst_page_ids, dtype="<i4")


@dataclass(frozen=True, slots=True)
class Abort:
    room: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    pass


@dataclass(frozen=True, slots=True)
class Bye:
    pass


@dataclass(frozen=True, slots=True)
class Registered:
    is_ok: bool
    reason: str | None
    agent_name: str
    heartbeat_interval_s: float
    peer_timeout_s: float


@dataclass(frozen=True, slots=True)
class Status:
    """``code`` (optional, v1-compatible) says why in a word a program can act on:
    ``unknown_peer`` means "register again, then repeat the want"; older peers ignore it."""

    room: int
    status: StatusCode
    reason: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str


@dataclass(frozen=True, slots=True)
class UnknownPeer:
    """The connection that sent a message is not a registered peer (dropped, or never was)."""

    reason: str


Message = Register | Want | Abort | Heartbeat | Bye | Registered | Status | Reject | UnknownPeer


def _regions_to_wire(regions: KVRegions) -> dict[str, Any]:
    lay = regions.layout
    return {
        "layout": {
            "num_layers": lay.num_layers,
            "num_kv_heads": lay.num_kv_heads,
            "head_dim": lay.head_dim,
            "dtype": lay.dtype,
            "page_size": lay.page_size,
            "num_pages": lay.num_pages,
        },
        "k_base_addrs": list(regions.k_base_addrs),
        "v_base_addrs": list(regions.v_base_addrs),
        "device": regions.device,
        "aux_base_addr": regions.aux_base_addr,
        "num_aux_rows": regions.num_aux_rows,
    }


def encode(msg: Message) -> bytes:
    body: dict[str, Any]
    match msg:
        case Register():
            body = {"type": "register", "agent_name": msg.agent_name, "metadata": msg.metadata}
            body |= _regions_to_wire(msg.regions) | {"compat_hash": msg.compat_hash}
        case Want():
            body = {"type": "want", "room": msg.room, "dst_page_ids": msg.packed_dst_page_ids}
            body |= {"dst_aux_slot": msg.dst_aux_slot, "num_cached_tokens": msg.num_cached_tokens}
        case Abort():
            body = {"type": "abort", "room": msg.room}
        case Heartbeat():
            body = {"type": "heartbeat"}
        case Bye():
            body = {"type": "bye"}
        case Registered():
            body = {"type": "registered", "ok": msg.is_ok, "reason": msg.reason}
            body |= {"agent_name": msg.agent_name, "peer_timeout_s": msg.peer_timeout_s}
            body |= {"heartbeat_interval_s": msg.heartbeat_interval_s}
        case Status():
            body = {"type": "status", "room": msg.room, "status": msg.status, "reason": msg.reason}
            if msg.code is not None:
                body["code"] = msg.code
        case Reject():
            body = {"type": "reject", "reason": msg.reason}
        case UnknownPeer():
            body = {"type": "unknown_peer", "reason": msg.reason}
    return msgpack.packb({"v": WIRE_VERSION} | body, use_bin_type=True)


class _Fields:
    """Typed access to one decoded map; every miss names the field."""

    def __init__(self, body: dict[Any, Any], where: str = "") -> None:
        self.body = body
        self.where = where

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.body:
            raise WireError(f"missing field {self.where}{key}")
        value = self.body[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise WireError(f"field {self.where}{key} has the wrong type")
        return value

    def opt_str(self, key: str) -> str | None:
        return None if self.body.get(key) is None else self.get(key, str)

    def int_list(self, key: str) -> tuple[int, ...]:
        values = self.get(key, list)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise WireError(f"field {self.where}{key} must hold integers")
        return tuple(values)


def _regions_from_wire(f: _Fields) -> KVRegions:
    lay = _Fields(f.get("layout", dict), "layout.")
    dtype = lay.get("dtype", str)
    if dtype not in DTYPE_ITEMSIZE:
        raise WireError(f"field layout.dtype: unknown dtype {dtype!r}")
    dims = [lay.get(k, int) for k in ("num_layers", "num_kv_heads", "head_dim", "page_size")]
    num_pages = lay.get("num_pages", int)
    if min([*dims, num_pages]) <= 0:
        raise WireError("field layout: sizes must be positive")
    layout = KVLayout(dims[0], dims[1], dims[2], dtype, dims[3], num_pages)
    k_addrs, v_addrs = f.int_list("k_base_addrs"), f.int_list("v_base_addrs")
    if len(k_addrs) != layout.num_layers or len(v_addrs) != layout.num_layers:
        raise WireError("field k_base_addrs/v_base_addrs: one address per layer needed")
    num_aux_rows = f.get("num_aux_rows", int)
    if num_aux_rows <= 0:
        raise WireError("field num_aux_rows must be positive")
    return KVRegions(
        layout, k_addrs, v_addrs, f.get("device", str), f.get("aux_base_addr", int), num_aux_rows
    )


def _decode_body(kind: str, f: _Fields) -> Message:
    match kind:
        case "register":
            return Register(
                f.get("agent_name", str),
                f.get("metadata", bytes),
                _regions_from_wire(f),
                f.get("compat_hash", str),
            )
        case "want":
            raw = f.get("dst_page_ids", bytes)
            if len(raw) % 4:
                raise WireError(f"field dst_page_ids is not packed int32 ({len(raw)} bytes)")
            return Want(
                f.get("room", int), raw, f.get("dst_aux_slot", int), f.get("num_cached_tokens", int)
            )
        case "abort":
            return Abort(f.get("room", int))
        case "heartbeat":
            return Heartbeat()
        case "bye":
            return Bye()
        case "registered":
            return Registered(
                f.get("ok", bool),
                f.opt_str("reason"),
                f.get("agent_name", str),
                float(f.get("heartbeat_interval_s", (int, float))),
                float(f.get("peer_timeout_s", (int, float))),
            )
        case "status":
            code = f.get("status", str)
            if code not in _STATUS_CODES:
                raise WireError(f"field status: unknown code {code!r}")
            return Status(f.get("room", int), code, f.opt_str("reason"), f.opt_str("code"))
        case "reject":
            return Reject(f.get("reason", str))
        case "unknown_peer":
            return UnknownPeer(f.get("reason", str))
    raise WireError(f"unknown message type {kind!r}")


def decode(frame: bytes) -> Message:
    """One message from one frame, or ``WireError`` naming what is wrong."""
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not a msgpack message: {exc}") from None
    if not isinstance(body, dict):
        raise WireError("message is not a map")
    f = _Fields(body)
    if f.get("v", int) != WIRE_VERSION:
        raise WireError(f"unsupported version {body['v']}, this side speaks {WIRE_VERSION}")
    return _decode_body(f.get("type", str), f)
