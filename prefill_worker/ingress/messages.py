"""Router ⇄ worker wire protocol v1 (docs/protocol.md, part 1): the messages as msgspec Structs.

Torch- and ZMQ-free. Every message is one ZMQ frame holding a msgpack map with ``"type"`` (the
union's tag) and ``"v": 1``. Token ids travel as packed little-endian int32 bytes and decode
into ``array("i")`` with one memcpy. Unknown extra keys are ignored. A field the sender left
out is ``UNSET`` (and is not written when encoding), as v1 leaves optional fields out rather
than sending null. The schema checks types and shapes; what depends on the model or the
worker's limits (vocabulary, prompt length, sampling ranges) is ``validate.py``'s. The
reference is ``docs/protocol.md``, whose JSON Schema is generated from these Structs.

Router → worker: ``prefill``, ``abort``, ``ping``, ``drain``.
Worker → router: ``result``, ``reject``, ``pong``.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from prefill_worker import msgpack_shape
from prefill_worker.request import FinishReason, Outcome, OutcomeStatus, SamplingParams, Timings

PROTOCOL_VERSION = 1
MAX_REQUEST_ID_CHARS = 256
MAX_PEER_NAME_CHARS = 256
MAX_TRACEPARENT_CHARS = 256  # W3C's version 00 takes 55
MAX_TRACESTATE_CHARS = 512  # W3C's 32 entries, as those who propagate it should keep

assert array("i").itemsize == 4, "array('i') must be 32-bit for the token codec"
_NEEDS_SWAP = sys.byteorder != "little"
_GREEDY = SamplingParams()

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
PeerName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_NAME_CHARS)]
Room = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # rooms are random 63-bit integers


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


_V_DOC = "protocol version; every frame carries it (the worker rejects a frame without it)"


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """A v1 frame: ``type`` is the tag, ``v`` the protocol version."""

    v: Annotated[int, msgspec.Meta(description=_V_DOC)] = PROTOCOL_VERSION


# ── router → worker ──────────────────────────────────────────────────────────────────────────


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """First-token sampling as sent; ranges are checked by ``SamplingParams.problem``."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | UnsetType | None = UNSET


class TraceContextField(msgspec.Struct, frozen=True, kw_only=True):
    """The router's W3C trace context, as its ``traceparent`` and ``tracestate`` HTTP headers
    would carry it; the worker's request span becomes the child of that span. A malformed
    ``traceparent`` is ignored (W3C's rule): the request is traced as a new root."""

    traceparent: Annotated[str, msgspec.Meta(max_length=MAX_TRACEPARENT_CHARS)]
    tracestate: Annotated[str, msgspec.Meta(max_length=MAX_TRACESTATE_CHARS)] | UnsetType | None = (
        UNSET
    )


class Prefill(_Message, tag="prefill", frozen=True, kw_only=True):
    request_id: RequestId
    token_ids: bytes  # packed little-endian int32: ``pack_tokens``
    bootstrap_room: Room
    sampling: Sampling | None = Sampling()
    return_logprob: bool = False
    deadline_s: float | UnsetType | None = UNSET  # whole-request budget, from arrival
    decode_peer: PeerName | UnsetType | None = UNSET  # the only decode agent that may claim
    # Optional, added to v1 with prompt logprobs. With return_logprob: the logprobs of the
    # prompt tokens after this position (SGLang's logprob_start_len); absent, nil or -1: none.
    logprob_start_len: int | UnsetType | None = UNSET
    # Optional, added to v1 with request tracing (docs/observability.md).
    trace_context: TraceContextField | UnsetType | None = UNSET


class Abort(_Message, tag="abort", frozen=True, kw_only=True):
    request_id: RequestId


class Ping(_Message, tag="ping", frozen=True, kw_only=True):
    nonce: int | UnsetType | None = UNSET  # echoed in the pong, so a router can match them


class Drain(_Message, tag="drain", frozen=True, kw_only=True):
    nonce: int | UnsetType | None = UNSET


RouterMessage = Prefill | Abort | Ping | Drain


def prefill_message(
    request_id: str,
    token_ids: Any,
    bootstrap_room: int,
    sampling: SamplingParams = _GREEDY,
    return_logprob: bool = False,
    deadline_s: float | None = None,
    decode_peer: str | None = None,
    logprob_start_len: int | None = None,
    traceparent: str | None = None,
) -> Prefill:
    """A ``prefill`` from the request vocabulary; ``token_ids`` as ``pack_tokens`` takes them."""
    seed = UNSET if sampling.seed is None else sampling.seed
    return Prefill(
        request_id=request_id,
        token_ids=pack_tokens(token_ids),
        bootstrap_room=bootstrap_room,
        sampling=Sampling(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed
        ),
        return_logprob=return_logprob,
        deadline_s=UNSET if deadline_s is None else deadline_s,
        decode_peer=UNSET if decode_peer is None else decode_peer,
        logprob_start_len=UNSET if logprob_start_len is None else logprob_start_len,
        trace_context=UNSET if traceparent is None else TraceContextField(traceparent=traceparent),
    )


# ── worker → router ──────────────────────────────────────────────────────────────────────────


class Result(_Message, tag="result", frozen=True, kw_only=True):
    """The one final answer to a ``prefill``."""

    request_id: str
    status: OutcomeStatus
    reason: FinishReason
    first_token_id: int | None = None
    num_prompt_tokens: int
    num_cached_tokens: int  # the prefix the decode node already held (not sent)
    timings: Timings
    first_token_logprob: float | UnsetType | None = UNSET  # only when asked for
    error: str | UnsetType | None = UNSET
    # Optional fields added to v1 with the prefix cache (workers before it leave them out):
    # the prefix the worker's own cache held (not computed), and the tokens it computed.
    num_prefix_hit_tokens: int | UnsetType = UNSET
    num_computed_tokens: int | UnsetType = UNSET
    # Optional, added to v1 with prompt logprobs; only when asked (logprob_start_len) and ok:
    # packed little-endian float32, the logprobs of prompt tokens [logprob_start_len + 1, n).
    prompt_logprobs: bytes | UnsetType = UNSET
    # Optional, added to v1 with optimistic prefill; only when some: prefills of this request
    # that yielded before its decode claimed the room (scheduler.optimistic_prefill).
    prefill_retries: int | UnsetType = UNSET


class Reject(_Message, tag="reject", frozen=True, kw_only=True):
    code: RejectCode
    message: str
    request_id: str | UnsetType | None = UNSET
    field: str | UnsetType | None = UNSET  # the field path, e.g. "sampling.top_p"
    nonce: int | UnsetType | None = UNSET  # a refused ``drain`` (or ``ping``) echoes its nonce


class Load(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's load as a ``pong`` reports it."""

    waiting: int
    running: int
    free_kv_pages: int
    draining: bool
    # The cost signals (docs/protocol.md): added in the same version, absent from older pongs.
    queued_tokens: int | UnsetType = UNSET
    running_tokens: int | UnsetType = UNSET
    prefill_rate_tps: float | UnsetType | None = UNSET  # None: no forward measured yet
    backlog_s: float | UnsetType | None = UNSET  # None: work queued, but no rate yet
    handshake_s: float | UnsetType = UNSET
    transfer_s: float | UnsetType = UNSET
    # The prediction's forward model (docs/protocol.md): added later, absent from older pongs.
    forward_s: float | UnsetType = UNSET
    arrival_tps: float | UnsetType = UNSET
    chunk_size: int | UnsetType = UNSET
    max_batch_tokens: int | UnsetType = UNSET


class Pong(_Message, tag="pong", frozen=True, kw_only=True):
    load: Load
    nonce: int | UnsetType | None = UNSET


WorkerMessage = Result | Reject | Pong


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


def pack_logprobs(logprobs: Sequence[float]) -> bytes:
    """Logprobs as little-endian float32 (what ``result.prompt_logprobs`` carries)."""
    packed = array("f", logprobs)
    if _NEEDS_SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_logprobs(data: bytes) -> array:
    """``result.prompt_logprobs`` as ``array("f")``."""
    return _unpack("f", data)


def unpack_tokens(data: bytes) -> array:
    return _unpack("i", data)


def _unpack(typecode: str, data: bytes) -> array:
    """Little-endian values of ``typecode`` (int32 or float32) as an array."""
    values = array(typecode)
    values.frombytes(data)
    if _NEEDS_SWAP:
        values.byteswap()
    return values


# ── encoding and decoding ────────────────────────────────────────────────────────────────────

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode  # one message as one frame
_worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
_WORKER_SHAPE = msgpack_shape.Shape(max_items=4096, max_total_items=4096)


def encode_outcome(outcome: Outcome, request_id: str | None = None) -> bytes:
    """The ``result`` for an engine outcome. The engine owns the logprob rule: the outcome
    carries logprobs only when the request asked (``return_logprob``, ``logprob_start_len``),
    and then they are sent.
    ``request_id`` replaces the outcome's (the ingress's scoped id) with the router's own."""
    logprob, prompt = outcome.first_token_logprob, outcome.prompt_logprobs
    result = Result(
        request_id=outcome.request_id if request_id is None else request_id,
        status=outcome.status,
        reason=outcome.reason,
        first_token_id=outcome.first_token_id,
        num_prompt_tokens=outcome.num_prompt_tokens,
        num_cached_tokens=outcome.num_cached_tokens,
        num_prefix_hit_tokens=outcome.num_prefix_hit_tokens,
        num_computed_tokens=outcome.num_computed_tokens,
        timings=outcome.timings,
        first_token_logprob=UNSET if logprob is None else logprob,
        prompt_logprobs=UNSET if prompt is None else pack_logprobs(prompt),
        error=UNSET if outcome.error is None else outcome.error,
        prefill_retries=outcome.prefill_retries or UNSET,
    )
    return _encoder.encode(result)


def decode_worker(frame: bytes) -> WorkerMessage:
    """A worker frame as a message; raises ``ProtocolError`` when it breaks the contract
    (nesting and item counts checked on the bytes first, as every peer decoder does)."""
    try:
        msgpack_shape.check(frame, _WORKER_SHAPE)
        msg = _worker_decoder.decode(frame)
    except (msgspec.DecodeError, msgpack_shape.ShapeError, RecursionError) as exc:
        raise ProtocolError(str(exc)) from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"v must be {PROTOCOL_VERSION}, got {msg.v}")
    return msg


def json_schema() -> dict[str, Any]:
    """The JSON Schema of every message, both directions (``docs/protocol.md`` embeds it)."""
    (router, worker), components = msgspec.json.schema_components(
        [RouterMessage, WorkerMessage], ref_template="#/$defs/{name}"
    )
    return {"router_to_worker": router, "worker_to_router": worker, "$defs": components}
