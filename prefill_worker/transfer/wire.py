"""The bootstrap protocol between a decode node and a worker: messages and codec. The messages,
their fields and the metadata frame are specified in docs/protocol.md, part 2.

Every message is one ZMQ frame: a msgpack map with ``"v": 1`` and ``"type"``. Never pickle.
Each message is one msgspec Struct below, tagged by ``type``; the Structs are the schema
(protocol.md embeds the JSON Schema made from them). Page ids travel as packed little-endian
int32 bytes. Unknown extra fields are ignored; an unknown type, a missing field or a wrong
type raises ``WireError`` naming the field path. Vocabulary and sizes that depend on this
worker are checked in ``validate.py``.

NIXL agent metadata travels inside ``register`` framed (``frame_metadata``: magic, version,
length, sha256), because a corrupt blob can crash ``add_remote_agent``; the frame is checked
before NIXL ever sees the bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from typing import Annotated, Any, Literal, cast, get_args

import msgspec
import numpy as np
from msgspec import UNSET, Meta, Struct, UnsetType, field

from prefill_worker import msgpack_shape
from prefill_worker.kv.layout import (
    DTYPE_ITEMSIZE,
    KV_KINDS,
    POOL_LAYOUTS,
    KVLayout,
    KVRegions,
    addresses_error,
)
from prefill_worker.kv.state_layout import StateComponent, StateRegions, StateTensor

WIRE_VERSION = 1
_FRAME_HEAD = struct.Struct("<4sB3sQ32s")
_FRAME_MAGIC = b"PWMD"
_FRAME_VERSION = 1

StatusCode = Literal["ok", "failed", "aborted"]
Dtype = Literal["float32", "bfloat16", "float16", "fp8_e4m3"]  # fp8_e4m3: an FP8 KV pool
PoolLayout = Literal["layer_major", "page_major", "vllm_blocks"]  # what cache.layout may pick
KvKind = Literal["layer_major", "page_major", "vllm_blocks", "mla"]  # a pool's kind on the wire
Positive = Annotated[int, Meta(ge=1)]
assert set(get_args(Dtype)) == set(DTYPE_ITEMSIZE)
assert get_args(PoolLayout) == POOL_LAYOUTS
assert get_args(KvKind) == KV_KINDS


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


def notif_tag(room: int) -> bytes:
    """The NIXL notification that marks a room's aux row as landed on the decode side: the
    worker sends it with the aux row's write, the decode SDK waits for it (so both compute it
    here)."""
    return b"pw1:room:%d" % room


class _Message(Struct, frozen=True, tag_field="type", kw_only=True):
    """Every message carries the protocol version; a frame without ``v`` is read as v1."""

    v: Literal[1] = 1


class Layout(Struct, frozen=True, omit_defaults=True):
    """A KV pool's shape (a ``KVLayout``): the decode's in ``register``, the worker's in
    ``described``. ``kind`` is left out when ``layer_major`` (v1's bytes, and what a peer
    that predates page-major means); ``mla`` is an MLA latent pool (``num_kv_heads`` 1,
    ``head_dim`` the latent width, no V addresses)."""

    num_layers: Positive
    num_kv_heads: Positive
    head_dim: Positive
    dtype: Dtype
    page_size: Positive
    num_pages: Positive
    kind: KvKind = "layer_major"

    @classmethod
    def of(cls, lay: KVLayout) -> Layout:
        dtype, kind = cast(Dtype, lay.dtype), cast(KvKind, lay.kind)
        return cls(
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            dtype,
            lay.page_size,
            lay.num_pages,
            kind,
        )

    def to_kv(self) -> KVLayout:
        return KVLayout(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.page_size,
            self.num_pages,
            self.kind,
        )


class DecodeRank(Struct, frozen=True):
    """A decode rank's place in its tensor-parallel (TP) group, in ``register``: its rank, the
    group's size, and the KV heads its pool holds, ``[head_start, head_stop)`` by the one
    rule (``kv.heads``). Absent: TP 1, every head (v1 decodes)."""

    tp_rank: Annotated[int, Meta(ge=0)]
    tp_size: Positive
    head_start: Annotated[int, Meta(ge=0)]
    head_stop: Positive


class WorkerRank(Struct, frozen=True):
    """One rank of the worker's TP group, in ``registered``: the heads its pool holds and the
    bootstrap endpoint that speaks for it."""

    tp_rank: Annotated[int, Meta(ge=0)]
    head_start: Annotated[int, Meta(ge=0)]
    head_stop: Positive
    endpoint: str


class WorkerTP(Struct, frozen=True):
    """The worker's TP layout, in ``registered`` when the decode named its rank."""

    tp_size: Positive
    ranks: tuple[WorkerRank, ...]


class StateTensorSpec(Struct, frozen=True):
    """One tensor of a state component: one item's shape, dtype and bytes (``StateTensor``)."""

    name: str
    item_shape: tuple[int, ...]
    dtype: Dtype
    item_bytes: Positive


class StatePool(Struct, frozen=True, kw_only=True):
    """One typed state component (``kv.state_layout``) of a pool: what it is (``kind``, the
    model layers it covers, its tensors, copied as ``copy`` ``when``) and, in ``register``,
    where the decode's lives: ``base_addrs[t][l]`` is item 0 of tensor t of layer l, on the
    register's ``device``. In ``described`` the worker's, without addresses."""

    kind: str
    layer_ids: tuple[int, ...]
    tensors: tuple[StateTensorSpec, ...]
    num_items: Positive
    copy: str
    when: str
    base_addrs: tuple[tuple[int, ...], ...]  # [tensor][layer]; empty in ``described``

    @classmethod
    def of(
        cls, component: StateComponent, base_addrs: tuple[tuple[int, ...], ...] = ()
    ) -> StatePool:
        tensors = tuple(
            StateTensorSpec(t.name, t.item_shape, cast(Dtype, t.dtype), t.item_bytes)
            for t in component.tensors
        )
        return cls(
            kind=component.kind,
            layer_ids=component.layer_ids,
            tensors=tensors,
            num_items=component.num_items,
            copy=component.copy,
            when=component.when,
            base_addrs=base_addrs,
        )

    @property
    def component(self) -> StateComponent:
        tensors = tuple(
            StateTensor(t.name, t.item_shape, t.dtype, t.item_bytes) for t in self.tensors
        )
        return StateComponent(
            self.kind, self.layer_ids, tensors, self.num_items, self.copy, self.when
        )

    def regions(self, device: str) -> StateRegions:
        """``ValueError`` when the addresses do not fit the component."""
        return StateRegions(self.component, self.base_addrs, device)


class DraftPool(Struct, frozen=True, kw_only=True):
    """A speculating decode's draft model (``model.draft``), in ``register``: its pool's
    layers, of the register's page geometry and device (one address per layer; no V for an
    mla pool), and its rows for the draft's first proposal, one per aux row, ``row_bytes``
    each in ``kv.draft_rows``'s format, in host memory."""

    k_base_addrs: tuple[int, ...]
    v_base_addrs: tuple[int, ...]
    rows_base_addr: int
    row_bytes: Positive

    def regions(self, target: KVRegions) -> KVRegions:
        """The draft's pool beside ``target`` (its aux fields: the rows); ``ValueError`` when
        its addresses do not fit."""
        layout = dataclasses.replace(target.layout, num_layers=len(self.k_base_addrs))
        return KVRegions(
            layout,
            self.k_base_addrs,
            self.v_base_addrs,
            target.device,
            self.rows_base_addr,
            target.num_aux_rows,
        )


class Register(_Message, frozen=True, tag="register"):
    """Decode → worker, once per connection (again when told ``unknown_peer``): where the
    decode pool lives, and the framed NIXL agent metadata."""

    # On the wire a flat KVRegions (v1's field order); ``of`` and ``regions`` convert at the edge.

    agent_name: str
    metadata: bytes  # framed, see frame_metadata
    layout: Layout
    k_base_addrs: tuple[int, ...]  # one per layer (an mla pool: its latent)
    v_base_addrs: tuple[int, ...]  # one per layer; empty for an mla pool
    device: str  # "cpu" or "cuda:N"
    aux_base_addr: int
    num_aux_rows: Positive
    compat_hash: str
    # Added after v1 (left out when unset, so v1 bytes are unchanged): a decode rank of TP > 1.
    tp: DecodeRank | UnsetType = UNSET
    # Added with hybrid models: the decode's pools of state components (linear-attention
    # state), on ``device``; a decode of a model without state leaves it out.
    state: tuple[StatePool, ...] | UnsetType = UNSET
    # Added with drafts: a speculating decode's draft pool and rows; left out by the others.
    draft: DraftPool | UnsetType = UNSET

    def __post_init__(self) -> None:
        why = addresses_error(self.layout.to_kv(), self.k_base_addrs, self.v_base_addrs)
        if why is not None:
            raise ValueError(f"{why} - at `$.k_base_addrs`")
        if self.draft is not UNSET:
            try:
                self.draft.regions(self.regions)
            except ValueError as exc:
                raise ValueError(f"{exc} - at `$.draft`") from None
        for pool in () if self.state is UNSET else self.state:
            try:
                pool.regions(self.device)
            except ValueError as exc:
                raise ValueError(f"{exc} - at `$.state`") from None

    @classmethod
    def of(
        cls,
        agent_name: str,
        metadata: bytes,
        regions: KVRegions,
        compat_hash: str,
        tp: DecodeRank | UnsetType = UNSET,
        state: tuple[StatePool, ...] | UnsetType = UNSET,
        draft: DraftPool | UnsetType = UNSET,
    ) -> Register:
        return cls(
            agent_name,
            metadata,
            Layout.of(regions.layout),
            regions.k_base_addrs,
            regions.v_base_addrs,
            regions.device,
            regions.aux_base_addr,
            regions.num_aux_rows,
            compat_hash,
            tp,
            state,
            draft,
        )

    @property
    def regions(self) -> KVRegions:
        return KVRegions(
            self.layout.to_kv(),
            self.k_base_addrs,
            self.v_base_addrs,
            self.device,
            self.aux_base_addr,
            self.num_aux_rows,
        )


class Want(_Message, frozen=True, tag="want"):
    """Decode → worker: send the KV of ``room`` into these pages; ``dst_page_ids`` is packed
    little-endian int32, 4 bytes per page."""

    # Page ids stay packed as they arrived: the worker checks the peer and the count before it
    # looks at them, and then only as a zero-copy int32 view, never a Python list (issue 12).

    room: int  # the 63-bit bootstrap_room
    packed_dst_page_ids: bytes = field(name="dst_page_ids")  # int32 little-endian
    dst_aux_slot: int
    num_cached_tokens: int
    # Added with hybrid models: the decode's slot that receives the room's state components
    # (every one of a register's ``state``); left out by a decode without state.
    dst_state_slot: int | UnsetType = UNSET

    def __post_init__(self) -> None:
        if len(self.packed_dst_page_ids) % 4:
            raise ValueError(
                f"dst_page_ids is not packed int32 ({len(self.packed_dst_page_ids)} bytes)"
                " - at `$.dst_page_ids`"
            )

    @classmethod
    def of(
        cls,
        room: int,
        dst_page_ids: Sequence[int],
        dst_aux_slot: int,
        num_cached_tokens: int,
        dst_state_slot: int | UnsetType = UNSET,
    ) -> Want:
        packed = np.asarray(dst_page_ids, dtype="<i4").tobytes()
        return cls(room, packed, dst_aux_slot, num_cached_tokens, dst_state_slot)

    @property
    def num_dst_pages(self) -> int:
        return len(self.packed_dst_page_ids) // 4

    @property
    def dst_page_ids(self) -> np.ndarray:
        """[num_dst_pages] int32, a read-only view of the packed bytes."""
        return np.frombuffer(self.packed_dst_page_ids, dtype="<i4")


class Abort(_Message, frozen=True, tag="abort"):
    """Decode → worker: stop this room; answered by ``status aborted``."""

    room: int


class Heartbeat(_Message, frozen=True, tag="heartbeat"):
    """Either way: liveness, every ``heartbeat_interval_s``."""


class Bye(_Message, frozen=True, tag="bye"):
    """Decode → worker: the decode node leaves; its open requests fail."""


class Describe(_Message, frozen=True, tag="describe"):
    """Decode → worker, from any connection (no registration needed): what does your pool
    look like? Answered by ``described``, so a decode can size its pool before ``register``."""


class Described(_Message, frozen=True, tag="described", kw_only=True):
    """Worker → decode, the answer to ``describe``: the worker's pool layout (its own
    ``num_pages``; a decode's may differ) and the ``compat_hash`` a ``register`` must carry."""

    agent_name: str  # the worker's
    layout: Layout
    compat_hash: str
    peer_timeout_s: float
    heartbeat_interval_s: float
    # Added with hybrid models: the state components a decode must register beside its KV
    # pool (no addresses; ``num_items`` the worker's own slots); left out for other models.
    state: tuple[StatePool, ...] | UnsetType = UNSET


class Registered(_Message, frozen=True, tag="registered", kw_only=True):
    """Worker → decode, the answer to ``register``: ``ok``, or the refusal's ``reason``."""

    # Keyword-only: the field order is v1's wire order (peer_timeout_s first), easy to swap.

    is_ok: bool = field(name="ok")
    reason: str | None = None
    agent_name: str  # the worker's
    peer_timeout_s: float
    heartbeat_interval_s: float
    tp: WorkerTP | UnsetType = UNSET  # sent to a decode whose register named its rank


class Status(_Message, frozen=True, tag="status"):
    """Worker → decode: the one outcome of a ``want``. ``code`` (optional, absent when unset;
    older peers ignore it) names a refusal in a word a program can act on: ``unknown_peer``
    means "register again, then repeat the want". ``traceparent`` (optional, added with
    request tracing) is the W3C context of the worker's span for the request, so that the
    decode's spans can continue its trace (docs/observability.md)."""

    room: int
    status: StatusCode
    reason: str | None = None
    code: str | UnsetType = UNSET
    traceparent: str | UnsetType = UNSET


class Reject(_Message, frozen=True, tag="reject"):
    """Worker → decode: an undecodable message (or one of more than one frame)."""

    reason: str


class UnknownPeer(_Message, frozen=True, tag="unknown_peer"):
    """The connection that sent a message is not a registered peer (dropped, or never was)."""

    reason: str


Message = (
    Register
    | Want
    | Abort
    | Heartbeat
    | Bye
    | Describe
    | Registered
    | Status
    | Reject
    | UnknownPeer
    | Described
)

_DECODER = msgspec.msgpack.Decoder(Message)
# A register holds two addresses per layer and a few fields: thousands of items at most. The
# scan runs on the engine thread, so its work per frame is bounded by the total.
_SHAPE = msgpack_shape.Shape(max_items=2048, max_total_items=4096)
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    """v1 bytes: ``v`` first, then ``type``, then the fields in declaration order."""
    # msgspec writes the tag first; v1 peers wrote ``v`` first. Via a dict the bytes stay
    # identical to v1's (tests/unit/transfer/v1_bootstrap_frames.json); UNSET fields are left out.
    body = msgspec.to_builtins(msg, builtin_types=(bytes,))
    return _ENCODER.encode({"v": WIRE_VERSION} | body)


def decode(frame: bytes) -> Message:
    """One message from one frame, or ``WireError`` naming what is wrong and where. Nesting
    and item counts are checked on the bytes first (``msgpack_shape``): a deep value in an
    ignored key is refused, never descended into."""
    try:
        msgpack_shape.check(frame, _SHAPE)
    except msgpack_shape.ShapeError as exc:
        raise WireError(f"not a bootstrap message: {exc}") from None
    try:
        return _DECODER.decode(frame)
    except msgspec.ValidationError as exc:
        raise WireError(str(exc)) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"not a msgpack message: {exc}") from None


def json_schema() -> dict[str, Any]:
    """The JSON Schema of every bootstrap message (bytes fields are msgpack ``bin``)."""
    return msgspec.json.schema(Message)
