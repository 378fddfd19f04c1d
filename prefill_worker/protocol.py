"""Router ⇄ worker wire protocol v1 (DESIGN §4): message types, msgpack codec, validation.

Torch- and ZMQ-free. Every message is one ZMQ frame holding a msgpack map with ``"v": 1`` and
``"type"``. Token ids travel as packed little-endian int32 bytes and decode into ``array("i")``
with one memcpy. Unknown extra keys are ignored. Anything a router sends that is not a valid
message decodes to a ``Reject`` (code + message naming the field) rather than raising, so the
ingress answers every frame. The reference is ``docs/protocol.md``.

Router → worker: ``prefill``, ``abort``, ``ping``, ``drain``.
Worker → router: ``result``, ``reject``, ``pong``.
"""

from __future__ import annotations

import enum
import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
    Timings,
)

PROTOCOL_VERSION = 1
MAX_REQUEST_ID_CHARS = 256
MAX_BOOTSTRAP_ROOM = 2**63  # exclusive: rooms are random 63-bit integers
MAX_PEER_NAME_CHARS = 256
# A router message is a small map of scalars and one bin; anything bigger is refused while
# unpacking, before Python objects are built for it (a 16 MiB array of ints costs ~1 s).
_MAX_ITEMS = 64  # per map or array
_SMALL_PROMPT = 64  # below this, a Python min/max beats numpy's call overhead

_GREEDY = SamplingParams()
assert array("i").itemsize == 4, "array('i') must be 32-bit for the token codec"
_NEEDS_SWAP = sys.byteorder != "little"


class RejectCode(str, enum.Enum):
    """Why a router message was refused; the ``code`` of a ``reject``."""

    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    MALFORMED = "malformed"
    MISSING_FIELD = "missing_field"
    BAD_FIELD = "bad_field"
    EMPTY_PROMPT = "empty_prompt"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    PROMPT_TOO_LONG = "prompt_too_long"
    BAD_SAMPLING = "bad_sampling"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    DRAINING = "draining"
    OVERLOADED = "overloaded"
    FORBIDDEN = "forbidden"


class ProtocolError(ValueError):
    """A worker → router frame the client cannot read (the worker broke the contract)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What a prompt must satisfy; ``max_pool_tokens`` is the whole KV pool in tokens."""

    vocab_size: int
    max_prompt_tokens: int
    max_pool_tokens: int


# ── router → worker ──────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class PrefillMsg:
    request_id: str
    token_ids: Sequence[int]  # decoded: array("i"); encoding also takes lists and numpy arrays
    bootstrap_room: int
    sampling: SamplingParams = _GREEDY
    return_logprob: bool = False
    deadline_s: float | None = None
    decode_peer: str | None = None  # the decode's NIXL agent name: only it may claim the room

    def to_request(self, arrival_time: float) -> PrefillRequest:
        return PrefillRequest(
            request_id=self.request_id,
            token_ids=self.token_ids,
            sampling=self.sampling,
            return_logprob=self.return_logprob,
            bootstrap_room=self.bootstrap_room,
            arrival_time=arrival_time,
            deadline_s=self.deadline_s,
            decode_peer=self.decode_peer,
        )


@dataclass(frozen=True, slots=True)
class AbortMsg:
    request_id: str

    def to_request(self) -> AbortRequest:
        return AbortRequest(self.request_id)


@dataclass(frozen=True, slots=True)
class PingMsg:
    nonce: int | None = None  # echoed in the pong, so a router can match them


@dataclass(frozen=True, slots=True)
class DrainMsg:
    nonce: int | None = None


RouterMsg = PrefillMsg | AbortMsg | PingMsg | DrainMsg  # what routers send (encode side)


# ── worker → router ──────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class ResultMsg:
    request_id: str
    status: OutcomeStatus
    reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token_id: int | None
    first_token_logprob: float | None
    error: str | None
    timings: Timings


@dataclass(frozen=True, slots=True)
class Reject:
    code: RejectCode
    message: str
    request_id: str | None = None
    field: str | None = None
    nonce: int | None = None  # a refused ``drain`` (or ``ping``) echoes its nonce


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The worker's load as a ``pong`` reports it."""

    waiting: int
    running: int
    free_kv_pages: int
    draining: bool


@dataclass(frozen=True, slots=True)
class PongMsg:
    load: LoadSnapshot
    nonce: int | None = None


WorkerMsg = ResultMsg | Reject | PongMsg


# ── token codec ──────────────────────────────────────────────────────────────────────────────


def pack_tokens(token_ids: Any) -> bytes:
    """Token ids (array("i"), numpy array, or a sequence of ints) as little-endian int32."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i4", copy=False).tobytes()
    packed = token_ids if isinstance(token_ids, array) and token_ids.typecode == "i" else None
    if packed is None:
        packed = array("i", token_ids)
    if _NEEDS_SWAP:
        packed = array("i", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> array:
    tokens = array("i")
    tokens.frombytes(data)
    if _NEEDS_SWAP:
        tokens.byteswap()
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


# ── encoding ─────────────────────────────────────────────────────────────────────────────────

_pack = msgpack.Packer(use_bin_type=True).pack


def _frame(type_: str, body: dict[str, Any]) -> bytes:
    body["v"] = PROTOCOL_VERSION
    body["type"] = type_
    return _pack(body)


def _sampling_map(s: SamplingParams) -> dict[str, Any]:
    m: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
    if s.seed is not None:
        m["seed"] = s.seed
    return m


def encode(msg: RouterMsg | WorkerMsg) -> bytes:
    """One message as one frame."""
    if isinstance(msg, PrefillMsg):
        return encode_prefill(msg)
    if isinstance(msg, AbortMsg):
        return _frame("abort", {"request_id": msg.request_id})
    if isinstance(msg, PingMsg | DrainMsg):
        body: dict[str, Any] = {} if msg.nonce is None else {"nonce": msg.nonce}
        return _frame("ping" if isinstance(msg, PingMsg) else "drain", body)
    if isinstance(msg, ResultMsg):
        return _encode_result(msg)
    if isinstance(msg, Reject):
        return encode_reject(msg)
    return encode_pong(msg.load, msg.nonce)


def encode_prefill(msg: PrefillMsg) -> bytes:
    body: dict[str, Any] = {
        "request_id": msg.request_id,
        "token_ids": pack_tokens(msg.token_ids),
        "bootstrap_room": msg.bootstrap_room,
        "sampling": _sampling_map(msg.sampling),
        "return_logprob": msg.return_logprob,
    }
    if msg.deadline_s is not None:
        body["deadline_s"] = msg.deadline_s
    if msg.decode_peer is not None:
        body["decode_peer"] = msg.decode_peer
    return _frame("prefill", body)


def encode_outcome(
    outcome: Outcome, return_logprob: bool = True, request_id: str | None = None
) -> bytes:
    """The ``result`` for an engine outcome; the logprob is sent only when it was asked for.
    ``request_id`` replaces the outcome's (the ingress's scoped id) with the router's own."""
    t = outcome.timings
    body: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": "result",
        "request_id": outcome.request_id if request_id is None else request_id,
        "status": outcome.status.value,
        "reason": outcome.reason.value,
        "first_token_id": outcome.first_token_id,
        "num_prompt_tokens": outcome.num_prompt_tokens,
        "num_cached_tokens": outcome.num_cached_tokens,
        "timings": {
            "queue_s": t.queue_s,
            "bootstrap_s": t.bootstrap_s,
            "prefill_s": t.prefill_s,
            "transfer_s": t.transfer_s,
        },
    }
    if return_logprob and outcome.first_token_logprob is not None:
        body["first_token_logprob"] = outcome.first_token_logprob
    if outcome.error is not None:
        body["error"] = outcome.error
    return _pack(body)


def _encode_result(r: ResultMsg) -> bytes:
    return encode_outcome(
        Outcome(
            r.request_id,
            r.status,
            r.reason,
            r.num_prompt_tokens,
            r.num_cached_tokens,
            r.first_token_id,
            r.first_token_logprob,
            r.error,
            r.timings,
        )
    )


def encode_reject(r: Reject) -> bytes:
    body: dict[str, Any] = {"code": r.code.value, "message": r.message}
    if r.request_id is not None:
        body["request_id"] = r.request_id
    if r.field is not None:
        body["field"] = r.field
    if r.nonce is not None:
        body["nonce"] = r.nonce
    return _frame("reject", body)


def encode_pong(load: LoadSnapshot, nonce: int | None = None) -> bytes:
    body: dict[str, Any] = {
        "load": {
            "waiting": load.waiting,
            "running": load.running,
            "free_kv_pages": load.free_kv_pages,
            "draining": load.draining,
        }
    }
    if nonce is not None:
        body["nonce"] = nonce
    return _frame("pong", body)


# ── decoding ─────────────────────────────────────────────────────────────────────────────────

_UNPACK_ERRORS = (ValueError, TypeError, OverflowError, msgpack.UnpackException)


class _Invalid(Exception):
    """Internal: one field is wrong; carries the reject that answers it."""

    def __init__(self, code: RejectCode, field: str | None, message: str) -> None:
        super().__init__(message)
        self.reject = Reject(code, message, None, field)


def _required(m: dict[str, Any], key: str, field: str) -> Any:
    try:
        return m[key]
    except KeyError:
        raise _Invalid(RejectCode.MISSING_FIELD, field, f"{field} is required") from None


def _int(value: Any, field: str, lo: int = -(2**63), hi: int = 2**64) -> int:
    if type(value) is not int:
        raise _Invalid(RejectCode.BAD_FIELD, field, f"{field} must be an integer")
    if not lo <= value < hi:
        raise _Invalid(RejectCode.BAD_FIELD, field, f"{field} must be in [{lo}, {hi})")
    return value


def _number(value: Any, field: str) -> float:
    if type(value) is not float and type(value) is not int:
        raise _Invalid(RejectCode.BAD_FIELD, field, f"{field} must be a number")
    return float(value)


def _bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise _Invalid(RejectCode.BAD_FIELD, field, f"{field} must be a boolean")
    return value


def _str(value: Any, field: str, max_chars: int = 1 << 20) -> str:
    if type(value) is not str or not 0 < len(value) <= max_chars:
        raise _Invalid(
            RejectCode.BAD_FIELD,
            field,
            f"{field} must be a non-empty string of <= {max_chars} characters",
        )
    return value


def _request_id(m: dict[str, Any]) -> str:
    return _str(_required(m, "request_id", "request_id"), "request_id", MAX_REQUEST_ID_CHARS)


def _text(value: Any, field: str) -> str:
    if type(value) is not str:
        raise _Invalid(RejectCode.BAD_FIELD, field, f"{field} must be a string")
    return value


def _map(value: Any, field: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise _Invalid(RejectCode.BAD_FIELD, field, f"{field} must be a map")
    return value


def _optional_nonce(m: dict[str, Any]) -> int | None:
    nonce = m.get("nonce")
    return None if nonce is None else _int(nonce, "nonce")


def _unpack_map(frame: bytes | memoryview, max_items: int = -1) -> dict[str, Any] | None:
    """The frame's map; -1: msgpack's default limits (the frame's size)."""
    try:
        obj = msgpack.unpackb(frame, raw=False, max_map_len=max_items, max_array_len=max_items)
    except _UNPACK_ERRORS:
        return None
    return obj if type(obj) is dict else None


def _check_version(m: dict[str, Any]) -> str:
    version = _required(m, "v", "v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise _Invalid(
            RejectCode.BAD_VERSION, "v", f"v must be {PROTOCOL_VERSION}, got {version!r:.40}"
        )
    type_ = _required(m, "type", "type")
    if type(type_) is not str:
        raise _Invalid(RejectCode.BAD_FIELD, "type", "type must be a string")
    return type_


def decode_router(
    frame: bytes | memoryview, limits: Limits, arrival_time: float = 0.0
) -> PrefillRequest | AbortRequest | PingMsg | DrainMsg | Reject:
    """A router frame as what the engine consumes, or the ``Reject`` that answers it.

    Never raises. A valid ``prefill`` becomes a ``PrefillRequest`` stamped ``arrival_time``.
    The cost is linear in the frame's size and small: the one big field, ``token_ids``, is
    copied once and range-checked by numpy; arrays and maps are capped while unpacking.
    """
    m = _unpack_map(frame, _MAX_ITEMS)
    if m is None:
        why = f"frame is not a msgpack map (maps and arrays of at most {_MAX_ITEMS} items)"
        return Reject(RejectCode.MALFORMED, why)
    request_id = None
    try:
        type_ = _check_version(m)
        if type_ == "prefill":
            request_id = _request_id(m)
            return _decode_prefill(m, request_id, limits, arrival_time)
        if type_ == "abort":
            return AbortRequest(_request_id(m))
        if type_ == "ping":
            return PingMsg(_optional_nonce(m))
        if type_ == "drain":
            return DrainMsg(_optional_nonce(m))
        raise _Invalid(RejectCode.UNKNOWN_TYPE, "type", f"unknown message type {type_!r:.40}")
    except _Invalid as exc:
        r = exc.reject
        return Reject(r.code, r.message, request_id, r.field)


def _decode_prefill(
    m: dict[str, Any], request_id: str, limits: Limits, arrival_time: float
) -> PrefillRequest:
    tokens = _decode_tokens(_required(m, "token_ids", "token_ids"), limits)
    room = _int(_required(m, "bootstrap_room", "bootstrap_room"), "bootstrap_room", 0, 2**63)
    sampling = _decode_sampling(m.get("sampling"))
    logprob = m.get("return_logprob", False)
    if type(logprob) is not bool:
        _bool(logprob, "return_logprob")
    deadline = m.get("deadline_s")
    if deadline is not None:
        deadline = _number(deadline, "deadline_s")
        if not (math.isfinite(deadline) and deadline > 0):
            raise _Invalid(RejectCode.BAD_FIELD, "deadline_s", "deadline_s must be > 0")
    peer = m.get("decode_peer")
    if peer is not None:
        peer = _str(peer, "decode_peer", MAX_PEER_NAME_CHARS)
    return PrefillRequest(request_id, tokens, sampling, logprob, room, arrival_time, deadline, peer)


def _decode_tokens(raw: Any, limits: Limits) -> array:
    if type(raw) is not bytes or len(raw) % 4:
        raise _Invalid(
            RejectCode.BAD_FIELD, "token_ids", "token_ids must be packed little-endian int32 bytes"
        )
    n = len(raw) // 4
    if n == 0:
        raise _Invalid(RejectCode.EMPTY_PROMPT, "token_ids", "token_ids is empty")
    if n > limits.max_prompt_tokens:
        raise _Invalid(
            RejectCode.PROMPT_TOO_LONG,
            "token_ids",
            f"token_ids has {n} tokens, over max_prompt_tokens={limits.max_prompt_tokens}",
        )
    if n > limits.max_pool_tokens:
        raise _Invalid(
            RejectCode.PROMPT_TOO_LONG,
            "token_ids",
            f"token_ids has {n} tokens, more than the KV pool holds ({limits.max_pool_tokens})",
        )
    tokens = unpack_tokens(raw)
    bad = _first_out_of_range(raw, tokens, limits.vocab_size)
    if bad is not None:
        raise _Invalid(
            RejectCode.TOKEN_OUT_OF_RANGE,
            "token_ids",
            f"token_ids[{bad}] = {tokens[bad]} is outside [0, {limits.vocab_size})",
        )
    return tokens


_sampling_cache: dict[tuple[float, float, int, int | None], SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 4096  # routers tend to repeat a few settings; seeds vary more


def _decode_sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return _GREEDY
    m = _map(raw, "sampling")
    seed = m.get("seed")
    key = (
        _number(m.get("temperature", 0.0), "sampling.temperature"),
        _number(m.get("top_p", 1.0), "sampling.top_p"),
        _int(m.get("top_k", 0), "sampling.top_k"),
        None if seed is None else _int(seed, "sampling.seed"),
    )
    params = _sampling_cache.get(key)
    if params is not None:
        return params
    params = SamplingParams(*key)
    problem = params.problem()
    if problem is not None:
        field, why = problem
        raise _Invalid(RejectCode.BAD_SAMPLING, field, f"{field} {why}")
    if len(_sampling_cache) >= _SAMPLING_CACHE_SIZE:
        _sampling_cache.clear()
    _sampling_cache[key] = params
    return params


def decode_worker(frame: bytes) -> WorkerMsg:
    """A worker frame as a message; raises ``ProtocolError`` when it breaks the contract."""
    m = _unpack_map(frame)
    if m is None:
        raise ProtocolError("frame is not a msgpack map")
    try:
        type_ = _check_version(m)
        if type_ == "result":
            return _decode_result(m)
        if type_ == "reject":
            return _decode_reject(m)
        if type_ == "pong":
            return _decode_pong(m)
        raise _Invalid(RejectCode.UNKNOWN_TYPE, "type", f"unknown message type {type_!r:.40}")
    except _Invalid as exc:
        raise ProtocolError(f"{exc.reject.code.value}: {exc.reject.message}") from None
    except ValueError as exc:  # an enum value outside the vocabulary
        raise ProtocolError(str(exc)) from None


def _optional(m: dict[str, Any], key: str, kind: Any) -> Any:
    value = m.get(key)
    return None if value is None else kind(value, key)


def _decode_result(m: dict[str, Any]) -> ResultMsg:
    t = _map(_required(m, "timings", "timings"), "timings")
    return ResultMsg(
        request_id=_str(_required(m, "request_id", "request_id"), "request_id"),
        status=OutcomeStatus(_str(_required(m, "status", "status"), "status")),
        reason=FinishReason(_str(_required(m, "reason", "reason"), "reason")),
        num_prompt_tokens=_int(_required(m, "num_prompt_tokens", "n"), "num_prompt_tokens"),
        num_cached_tokens=_int(_required(m, "num_cached_tokens", "n"), "num_cached_tokens"),
        first_token_id=_optional(m, "first_token_id", _int),
        first_token_logprob=_optional(m, "first_token_logprob", _number),
        error=_optional(m, "error", _text),
        timings=Timings(
            **{k: _number(t.get(k, 0.0), f"timings.{k}") for k in Timings.__dataclass_fields__}
        ),
    )


def _decode_reject(m: dict[str, Any]) -> Reject:
    return Reject(
        code=RejectCode(_str(_required(m, "code", "code"), "code")),
        message=_text(_required(m, "message", "message"), "message"),
        request_id=_optional(m, "request_id", _str),
        field=_optional(m, "field", _str),
        nonce=_optional(m, "nonce", _int),
    )


def _decode_pong(m: dict[str, Any]) -> PongMsg:
    load = _map(_required(m, "load", "load"), "load")
    return PongMsg(
        LoadSnapshot(
            waiting=_int(_required(load, "waiting", "load.waiting"), "load.waiting"),
            running=_int(_required(load, "running", "load.running"), "load.running"),
            free_kv_pages=_int(
                _required(load, "free_kv_pages", "load.free_kv_pages"), "load.free_kv_pages"
            ),
            draining=_bool(_required(load, "draining", "load.draining"), "load.draining"),
        ),
        _optional_nonce(m),
    )
