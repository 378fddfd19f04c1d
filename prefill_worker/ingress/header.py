"""A router frame's top-level map read without decoding its values: the shape caps, then the
header (``v`` before ``type``, so that a frame of another version is told so).

Safety caps, checked on the bytes before anything is built (``malformed``): the frame's map,
and every array or map in ``token_ids``, ``sampling`` or an unknown key, hold at most
``MAX_ITEMS`` items, nest at most ``msgpack_shape.MAX_DEPTH`` deep (the frame's map counted)
and hold ``MAX_TOTAL_ITEMS`` items per field in all. A container where a scalar belongs is a
type error (``bad_field``, from the typed decode) found on its header, never descended into;
one nested past the interpreter's recursion limit stops msgspec's skip over it here
(``malformed``). Used by ``validate.decode_router`` on the ingress I/O thread only.
"""

from __future__ import annotations

import msgspec

from prefill_worker.ingress.messages import PROTOCOL_VERSION, Reject, RejectCode
from prefill_worker.msgpack_shape import (
    MAX_DEPTH,
    Shape,
    ShapeError,
    check,
    is_container,
    num_items,
)

MAX_ITEMS = 64  # per map or array
MAX_TOTAL_ITEMS = 1024  # in one field's containers together; v1 frames hold a few
MALFORMED = (
    f"frame is not a msgpack map (maps and arrays of at most {MAX_ITEMS} items,"
    f" nested at most {MAX_DEPTH} deep)"
)
_FIELD_SHAPE = Shape(MAX_DEPTH - 1, MAX_ITEMS, MAX_TOTAL_ITEMS)  # inside the frame's map
# Fields whose value msgspec refuses on its header when it is a container (a type error, never
# descended into); every other value's shape is checked on its bytes.
_SCALAR_FIELDS = frozenset(
    {
        "v",
        "type",
        "request_id",
        "bootstrap_room",
        "return_logprob",
        "deadline_s",
        "decode_peer",
        "logprob_start_len",
        "nonce",
    }
)
_TAGS = {msgspec.msgpack.encode(t): t for t in ("prefill", "abort", "ping", "drain")}
_VERSION = msgspec.msgpack.encode(PROTOCOL_VERSION)
_GOOD_SHAPES_SIZE = 4096
_GOOD_SHAPE_MAX_BYTES = 256
_good_shapes: set[bytes] = set()  # field values that passed the check
_raw_map = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


class _Container:
    """Stands for a header field's array or map in a reject's text (it is not decoded)."""

    def __repr__(self) -> str:
        return "an array or map"


_CONTAINER = _Container()


def read_header(frame: bytes | memoryview) -> dict[str, msgspec.Raw] | None:
    """The top-level map with its values still encoded, or None when malformed or beyond
    the caps.

    msgspec skips over each value to find the next key without building it; a value nested
    past the interpreter's recursion limit makes that skip raise ``RecursionError``, and
    nothing has been built then either."""
    if num_items(frame) > MAX_ITEMS:
        return None
    try:
        raws = _raw_map.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return None
    for key in raws.keys() - _SCALAR_FIELDS:  # token_ids, sampling, unknown keys
        raw = memoryview(raws[key])
        if not is_container(raw):
            continue
        value = bytes(raw)
        if value not in _good_shapes:
            try:
                check(value, _FIELD_SHAPE)
            except ShapeError:
                return None
            _remember_good_shape(value)
    return raws


def _remember_good_shape(value: bytes) -> None:
    """Routers repeat a few ``sampling`` maps: each is scanned once, then found here."""
    if len(_good_shapes) >= _GOOD_SHAPES_SIZE:
        _good_shapes.clear()
    if len(value) <= _GOOD_SHAPE_MAX_BYTES:
        _good_shapes.add(value)


def message_type(raws: dict[str, msgspec.Raw]) -> str | Reject:
    """The frame's ``type`` tag, or the ``Reject`` for its ``v`` or ``type``."""
    version = raws.get("v")
    if version is None:
        return _reject(RejectCode.MISSING_FIELD, "v", "v is required")
    if bytes(version) != _VERSION:
        got = _decode_scalar(version)
        why = f"v must be {PROTOCOL_VERSION}, got {got!r:.40}"
        return got if isinstance(got, Reject) else _reject(RejectCode.BAD_VERSION, "v", why)
    raw_type = raws.get("type")
    if raw_type is None:
        return _reject(RejectCode.MISSING_FIELD, "type", "type is required")
    type_ = _TAGS.get(bytes(raw_type))
    if type_ is not None:
        return type_
    got = _decode_scalar(raw_type)
    if isinstance(got, Reject):
        return got
    if type(got) is not str:
        return _reject(RejectCode.BAD_FIELD, "type", "type must be a string")
    return _reject(RejectCode.UNKNOWN_TYPE, "type", f"unknown message type {got!r:.40}")


def _decode_scalar(raw: msgspec.Raw) -> object:
    """A header field's value for the reject's text: scalars only (a container is never
    built here, however deep); a ``Reject`` when it is not msgpack."""
    if is_container(memoryview(raw)):
        return _CONTAINER
    try:
        return msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return Reject(code=RejectCode.MALFORMED, message=MALFORMED)


def _reject(code: RejectCode, field: str, message: str) -> Reject:
    return Reject(code=code, message=message, field=field)
