"""From a router's frame to what the engine consumes, or the ``Reject`` that answers it.

The one owner of what a valid request is. The schema (``messages.py``) checks types and
shapes, with msgspec errors naming the field path; this module maps those to reject codes and
adds what depends on the worker: prompt length against the model and the KV pool, token ids
against the vocabulary, sampling and deadline ranges. Never raises: every frame is answered.

Safety caps, checked on the bytes before anything is built (``malformed``): the frame's map,
and every array or map in ``token_ids``, ``sampling`` or an unknown key, hold at most
``_MAX_ITEMS`` items, nest at most ``msgpack_shape.MAX_DEPTH`` deep (the frame's map counted)
and hold ``_MAX_TOTAL_ITEMS`` items per field in all. A container where a scalar belongs is a
type error (``bad_field``) found on its header, never descended into; one nested past the
interpreter's recursion limit stops msgspec's skip over it (``malformed``). Frames over the
size limit never get here (ZMQ drops them).
"""

from __future__ import annotations

import math
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
from msgspec import UNSET

from prefill_worker.msgpack_shape import (
    MAX_DEPTH,
    Shape,
    ShapeError,
    check,
    is_container,
    num_items,
)
from prefill_worker.request import AbortRequest, PrefillRequest, SamplingParams
from prefill_worker.router.messages import (
    MAX_REQUEST_ID_CHARS,
    PROTOCOL_VERSION,
    Abort,
    Drain,
    Ping,
    Prefill,
    Reject,
    RejectCode,
    RouterMessage,
    Sampling,
    unpack_tokens,
)

_MAX_ITEMS = 64  # per map or array
_MAX_TOTAL_ITEMS = 1024  # in one field's containers together; v1 frames hold a few
_FIELD_SHAPE = Shape(MAX_DEPTH - 1, _MAX_ITEMS, _MAX_TOTAL_ITEMS)  # inside the frame's map
_good_shapes: set[bytes] = set()  # field values that passed the check (I/O thread only)
_GOOD_SHAPES_SIZE = 4096
_GOOD_SHAPE_MAX_BYTES = 256
_SMALL_PROMPT = 64  # below this, a Python min/max beats numpy's call overhead
_TAGS = {msgspec.msgpack.encode(t): t for t in ("prefill", "abort", "ping", "drain")}
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
_VERSION = msgspec.msgpack.encode(PROTOCOL_VERSION)
_NEEDS_SWAP = sys.byteorder != "little"  # token_ids travel little-endian
_GREEDY = SamplingParams()
_MALFORMED = (
    f"frame is not a msgpack map (maps and arrays of at most {_MAX_ITEMS} items,"
    f" nested at most {MAX_DEPTH} deep)"
)
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


class _Container:
    """Stands for a header field's array or map in a reject's text (it is not decoded)."""

    def __repr__(self) -> str:
        return "an array or map"


_CONTAINER = _Container()
_raw_map = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_router_decoder = msgspec.msgpack.Decoder(RouterMessage)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a prompt must satisfy; ``max_pool_tokens`` is the whole KV pool in tokens."""

    vocab_size: int
    max_prompt_tokens: int
    max_pool_tokens: int


class _Invalid(Exception):
    """Internal: one field is wrong; carries the reject that answers it."""

    def __init__(self, code: RejectCode, field: str | None, message: str) -> None:
        super().__init__(message)
        self.reject = Reject(code=code, message=message, field=UNSET if field is None else field)


def decode_router(
    frame: bytes | memoryview, limits: Limits, arrival_time: float = 0.0, id_prefix: str = ""
) -> PrefillRequest | AbortRequest | Ping | Drain | Reject:
    """A router frame as what the engine consumes, or the ``Reject`` that answers it.

    A valid ``prefill`` becomes a ``PrefillRequest`` stamped ``arrival_time``, whose id is the
    router's with ``id_prefix`` before it (the ingress scopes ids by connection, and builds
    the request once rather than copying it with another id). The cost is
    linear in the frame's size and small: ``token_ids`` is copied once and range-checked by
    numpy."""
    raws = _header_map(frame)
    if raws is None:
        return Reject(code=RejectCode.MALFORMED, message=_MALFORMED)
    try:
        type_ = _check_header(raws)
    except _Invalid as exc:
        return exc.reject
    try:
        msg = _decode_typed(frame)
        if isinstance(msg, Prefill):
            return _admit_prefill(msg, limits, arrival_time, id_prefix)
    except _Invalid as exc:
        return _with_request_id(exc.reject, raws) if type_ == "prefill" else exc.reject
    if isinstance(msg, Abort):
        return AbortRequest(msg.request_id)
    return msg


class PromptRefused(ValueError):
    """A prompt that another ingress (the HTTP front) must refuse, with the reject code."""

    def __init__(self, code: RejectCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_token_ids(token_ids: Sequence[int], limits: Limits) -> array:
    """A prompt given as ints, checked exactly as a ``prefill`` frame's ``token_ids`` is (the
    one owner of that policy for every ingress); raises ``PromptRefused``."""
    try:
        packed = array("i", token_ids)
    except OverflowError:
        why = f"token_ids hold a value outside [0, {limits.vocab_size})"
        raise PromptRefused(RejectCode.TOKEN_OUT_OF_RANGE, why) from None
    if _NEEDS_SWAP:
        packed.byteswap()
    try:
        return _check_tokens(packed.tobytes(), limits)
    except _Invalid as exc:
        raise PromptRefused(exc.reject.code, exc.reject.message) from None


def check_logprob_start(start: int | None, num_tokens: int) -> int | None:
    """SGLang's ``logprob_start_len`` for a prompt of ``num_tokens``: the position whose
    following tokens get prompt logprobs, or None (absent or -1: none). Beyond the prompt is
    refused, as SGLang refuses it; the one owner of that rule for every ingress. Raises
    ``PromptRefused``."""
    if start is None or start == -1:
        return None
    if not 0 <= start <= num_tokens:
        why = f"logprob_start_len must be -1 or in [0, {num_tokens}] (the prompt's length)"
        raise PromptRefused(RejectCode.BAD_FIELD, f"{why}, got {start}")
    return start


def _header_map(frame: bytes | memoryview) -> dict[str, msgspec.Raw] | None:
    """The top-level map with its values still encoded, or None when malformed or too big.

    msgspec skips over each value to find the next key without building it; a value nested
    past the interpreter's recursion limit makes that skip raise ``RecursionError``, and
    nothing has been built then either."""
    if num_items(frame) > _MAX_ITEMS:
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


def _check_header(raws: dict[str, msgspec.Raw]) -> str:
    """``v`` before ``type``, so that a frame from another version is told so."""
    version = raws.get("v")
    if version is None:
        raise _Invalid(RejectCode.MISSING_FIELD, "v", "v is required")
    if bytes(version) != _VERSION:
        got = _decode_raw(version)
        why = f"v must be {PROTOCOL_VERSION}, got {got!r:.40}"
        raise _Invalid(RejectCode.BAD_VERSION, "v", why)
    raw_type = raws.get("type")
    if raw_type is None:
        raise _Invalid(RejectCode.MISSING_FIELD, "type", "type is required")
    type_ = _TAGS.get(bytes(raw_type))
    if type_ is not None:
        return type_
    got = _decode_raw(raw_type)
    if type(got) is not str:
        raise _Invalid(RejectCode.BAD_FIELD, "type", "type must be a string")
    raise _Invalid(RejectCode.UNKNOWN_TYPE, "type", f"unknown message type {got!r:.40}")


def _decode_raw(raw: msgspec.Raw) -> object:
    """A header field's value for the reject's text: scalars only (a container is never
    built here, however deep)."""
    if is_container(memoryview(raw)):
        return _CONTAINER
    try:
        return msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        raise _Invalid(RejectCode.MALFORMED, None, _MALFORMED) from None


def _decode_typed(frame: bytes | memoryview) -> RouterMessage:
    try:
        return _router_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None
    except (msgspec.DecodeError, RecursionError):  # a value deeper down is not valid msgpack
        raise _Invalid(RejectCode.MALFORMED, None, _MALFORMED) from None


def _field_error(text: str) -> _Invalid:
    """msgspec's error (``Expected `int`, got `str` - at `$.sampling.top_k```) as a reject
    naming the field path."""
    at = _PATH.search(text)
    path = at.group(1) if at else ""
    why = text[: at.start()] if at else text
    missing = _MISSING.match(why)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return _Invalid(RejectCode.MISSING_FIELD, field, f"{field} is required")
    return _Invalid(RejectCode.BAD_FIELD, path, f"{path}: {why}")


def _with_request_id(reject: Reject, raws: dict[str, msgspec.Raw]) -> Reject:
    """A refused ``prefill`` names the router's request id, when that id itself is valid."""
    raw_id = raws.get("request_id")
    if raw_id is None or reject.field == "request_id" or reject.code is RejectCode.MALFORMED:
        return reject
    try:
        request_id = msgspec.msgpack.decode(raw_id, type=str)
    except msgspec.DecodeError:
        return reject
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        return reject
    return msgspec.structs.replace(reject, request_id=request_id)


def _admit_prefill(
    msg: Prefill, limits: Limits, arrival_time: float, id_prefix: str
) -> PrefillRequest:
    tokens = _check_tokens(msg.token_ids, limits)
    deadline = msg.deadline_s
    if deadline is None or deadline is UNSET:
        deadline = None
    elif not (math.isfinite(deadline) and deadline > 0):
        raise _Invalid(RejectCode.BAD_FIELD, "deadline_s", "deadline_s must be > 0")
    peer = msg.decode_peer if isinstance(msg.decode_peer, str) else None
    sampling = _check_sampling(msg.sampling)
    start = msg.logprob_start_len if isinstance(msg.logprob_start_len, int) else None
    try:
        logprob_start = check_logprob_start(start, len(tokens))
    except PromptRefused as exc:
        raise _Invalid(exc.code, "logprob_start_len", str(exc)) from None
    return PrefillRequest(
        id_prefix + msg.request_id,
        tokens,
        sampling,
        msg.return_logprob,
        msg.bootstrap_room,
        arrival_time,
        deadline,
        peer,
        logprob_start,
    )


def _check_tokens(raw: bytes, limits: Limits) -> array:
    if len(raw) % 4:
        why = "token_ids must be packed little-endian int32 bytes"
        raise _Invalid(RejectCode.BAD_FIELD, "token_ids", why)
    n = len(raw) // 4
    if n == 0:
        raise _Invalid(RejectCode.EMPTY_PROMPT, "token_ids", "token_ids is empty")
    if n > limits.max_prompt_tokens:
        why = f"token_ids has {n} tokens, over max_prompt_tokens={limits.max_prompt_tokens}"
        raise _Invalid(RejectCode.PROMPT_TOO_LONG, "token_ids", why)
    if n > limits.max_pool_tokens:
        why = f"token_ids has {n} tokens, more than the KV pool holds ({limits.max_pool_tokens})"
        raise _Invalid(RejectCode.PROMPT_TOO_LONG, "token_ids", why)
    tokens = unpack_tokens(raw)
    bad = _first_out_of_range(raw, tokens, limits.vocab_size)
    if bad is not None:
        why = f"token_ids[{bad}] = {tokens[bad]} is outside [0, {limits.vocab_size})"
        raise _Invalid(RejectCode.TOKEN_OUT_OF_RANGE, "token_ids", why)
    return tokens


def _first_out_of_range(data: bytes, tokens: array, vocab_size: int) -> int | None:
    """Index of the first id outside ``[0, vocab_size)``, or None; no per-token Python loop."""
    if len(tokens) < _SMALL_PROMPT:
        if min(tokens) >= 0 and max(tokens) < vocab_size:
            return None
    else:
        as_unsigned = np.frombuffer(data, dtype="<u4")  # negatives wrap to >= 2**31
        if int(as_unsigned.max()) < vocab_size:
            return None
        return int(np.argmax(as_unsigned >= vocab_size))
    return next(i for i, t in enumerate(tokens) if not 0 <= t < vocab_size)


_sampling_cache: dict[Sampling, SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 4096  # routers tend to repeat a few settings; seeds vary more


def _check_sampling(sampling: Sampling | None) -> SamplingParams:
    if sampling is None:
        return _GREEDY
    params = _sampling_cache.get(sampling)
    if params is not None:
        return params
    seed = sampling.seed if isinstance(sampling.seed, int) else None
    params = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed)
    problem = params.problem()
    if problem is not None:
        field, why = problem
        raise _Invalid(RejectCode.BAD_SAMPLING, field, f"{field} {why}")
    if len(_sampling_cache) >= _SAMPLING_CACHE_SIZE:
        _sampling_cache.clear()
    _sampling_cache[sampling] = params
    return params
