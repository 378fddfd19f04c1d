"""What the bootstrap server accepts from a decode peer, decided before any work is done.

A ``register`` is checked in full (layout, sizes, addresses, device) before NIXL sees its
metadata or a descriptor table is built; a ``want`` is checked for size before its page ids
are looked at. Each refusal carries a ``RejectReason`` (the label of
``prefill_worker_bootstrap_rejects_total``) and a message with the numbers. Torch-free.

Limits, and why:

    max_peer_pages     decode pool pages (and aux rows) one peer may register; the strided
                       descriptor lists (``pagemap``) cost the same at any size; it bounds
                       what a want may name and the descriptor index space
    2**31 - 1          descriptor indices are int32 (what NIXL takes)
    2**64              a region [base, base + pages * page_bytes) must fit the address space
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.latent import mla_mismatch

DEFAULT_MAX_PEER_PAGES = 2**20
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_MAX_DESCRIPTORS = 2**31 - 1
ADDRESS_SPACE = 2**64
_MAX_AGENT_NAME = 255
_DEVICE = re.compile(r"cpu|cuda:[0-9]{1,4}")


class RejectReason(enum.Enum):
    """Why the bootstrap server refused a message or a peer (a metric label)."""

    BAD_MESSAGE = "bad_message"  # undecodable, or the wrong number of frames
    BAD_METADATA = "bad_metadata"  # the metadata frame (length, checksum, magic)
    LAYOUT_MISMATCH = "layout_mismatch"
    TOO_LARGE = "too_large"  # pages, aux rows or descriptors past the limits
    BAD_ADDRESS = "bad_address"
    BAD_DEVICE = "bad_device"
    BAD_NAME = "bad_name"
    NAME_TAKEN = "name_taken"  # another live connection holds the agent name
    NIXL_REFUSED = "nixl_refused"
    UNKNOWN_PEER = "unknown_peer"  # a message from a connection that is not registered
    BAD_WANT = "bad_want"  # more pages than any prompt could need
    DUPLICATE_WANT = "duplicate_want"
    FOREIGN_ROOM = "foreign_room"  # the router reserved the room for another decode peer
    TOO_MANY_WANTS = "too_many_wants"  # unmatched wants per peer past the bound
    INTERNAL_ERROR = "internal_error"  # a message raised anyway: its peer is dropped
    UNSUPPORTED = "unsupported"  # an SGLang decode feature this worker does not serve
    SPOOFED_ADDRESS = "spoofed_address"  # an SGLang frame's ip is not its connection's
    NETWORK_NOT_ALLOWED = "network_not_allowed"  # outside transfer.sglang_allowed_networks
    ADDRESS_TAKEN = "address_taken"  # a live SGLang decode is registered at that ip:port
    FOREIGN_AGENT = "foreign_agent"  # a request names an agent registered at another ip:port
    WRONG_DP_RANK = "wrong_dp_rank"  # a room another attention-DP rank of the worker serves


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: RejectReason
    message: str


@dataclass(frozen=True, slots=True)
class BootstrapLimits:
    """Bounds on what one decode peer may ask of the worker (see the module docstring)."""

    max_peer_pages: int = DEFAULT_MAX_PEER_PAGES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_unmatched_wants: int = 4096  # per peer: wants waiting for their router request


def check_register(msg: wire.Register, ours: KVLayout, limits: BootstrapLimits) -> Refusal | None:
    """Why this ``register`` cannot be accepted, or None; never touches NIXL."""
    return (
        _check_name(msg.agent_name)
        or _check_layout(msg, ours)
        or _check_sizes(msg.regions, limits)
        or _check_device(msg.regions.device)
        or _check_addresses(msg.regions)
        or _check_metadata(msg.metadata)
    )


def check_want_size(want: wire.Want, ours: KVLayout, peer: KVLayout) -> Refusal | None:
    """A ``want`` naming more pages than our pool (no prompt can need more) or the peer's."""
    bound = min(ours.num_pages, peer.num_pages)
    if want.num_dst_pages > bound:
        return Refusal(
            RejectReason.BAD_WANT,
            f"want names {want.num_dst_pages} pages; at most {bound} can be needed",
        )
    return None


def _check_name(name: str) -> Refusal | None:
    if not 0 < len(name.encode()) <= _MAX_AGENT_NAME:
        return Refusal(RejectReason.BAD_NAME, f"agent_name must be 1..{_MAX_AGENT_NAME} bytes")
    return None


def _check_layout(msg: wire.Register, ours: KVLayout) -> Refusal | None:
    theirs = msg.regions.layout
    why = mla_mismatch(theirs, ours)
    if why is not None:
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    if theirs.kind != ours.kind:
        return Refusal(
            RejectReason.LAYOUT_MISMATCH,
            f"KV layout mismatch: the decode pool is {theirs.kind}, this worker's is "
            f"{ours.kind}; allocate the decode pool {ours.kind} (or run the worker with "
            f"cache.layout: {theirs.kind})",
        )
    shape = (theirs.num_layers, theirs.num_kv_heads, theirs.head_dim, theirs.dtype)
    if (
        shape != (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.dtype)
        or theirs.page_size != ours.page_size
        or msg.compat_hash != ours.compat_hash()
    ):
        return Refusal(
            RejectReason.LAYOUT_MISMATCH, f"KV layout mismatch: decode {theirs}, worker {ours}"
        )
    return None


def _check_sizes(regions: KVRegions, limits: BootstrapLimits) -> Refusal | None:
    lay, bound = regions.layout, limits.max_peer_pages
    if lay.num_pages > bound or regions.num_aux_rows > bound:
        return Refusal(
            RejectReason.TOO_LARGE,
            f"decode pool of {lay.num_pages} pages and {regions.num_aux_rows} aux rows; "
            f"this worker takes at most {bound} of each (transfer.max_peer_pages)",
        )
    num_descriptors = lay.num_regions * lay.num_pages + regions.num_aux_rows
    if num_descriptors > _MAX_DESCRIPTORS:
        return Refusal(
            RejectReason.TOO_LARGE,
            f"{num_descriptors} descriptors exceed the int32 index space ({_MAX_DESCRIPTORS})",
        )
    return None


def _check_device(device: str) -> Refusal | None:
    if _DEVICE.fullmatch(device) is None:
        return Refusal(RejectReason.BAD_DEVICE, f"device {device[:40]!r} is not cpu or cuda:N")
    return None


def _check_addresses(regions: KVRegions) -> Refusal | None:
    spans = [(a, regions.layout.region_bytes) for a in regions.region_base_addrs]
    spans.append((regions.aux_base_addr, regions.num_aux_rows * AUX_ROW_BYTES))
    return outside_address_space("region", spans)


def outside_address_space(what: str, spans: Sequence[tuple[int, int]]) -> Refusal | None:
    """The first of a peer's (address, size) spans that does not fit the address space."""
    for i, (addr, size) in enumerate(spans):
        if addr <= 0 or addr + size > ADDRESS_SPACE:
            return Refusal(
                RejectReason.BAD_ADDRESS,
                f"{what} {i} [{addr}, {addr} + {size}) is outside the 64-bit address space",
            )
    return None


def _check_metadata(framed: bytes) -> Refusal | None:
    try:
        wire.unframe_metadata(framed)
    except wire.WireError as exc:
        return Refusal(RejectReason.BAD_METADATA, str(exc))
    return None


def duplicate_want(room: int) -> Refusal:
    return Refusal(RejectReason.DUPLICATE_WANT, f"duplicate want for {room}")


def foreign_room(room: int) -> Refusal:
    why = f"room {room} is reserved by the router for another decode peer"
    return Refusal(RejectReason.FOREIGN_ROOM, why)
