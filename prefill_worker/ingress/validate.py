"""From a router's frame to what the engine consumes, or the ``Reject`` that answers it.

The one owner of what a valid request is. The schema (``messages.py``) checks types and
shapes, with msgspec errors naming the field path; this module maps those to reject codes and
adds what depends on the worker: prompt length against the model and the KV pool, token ids
against the vocabulary, sampling and deadline ranges. Never raises: every frame is answered.

The frame's shape (item and depth caps) and its header (``v`` before ``type``) are read first,
without decoding its values, by ``header.py``. Frames over the size limit never get here (ZMQ
drops them).
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
from msgspec import UNSET, UnsetType

from prefill_worker.ingress.header import MALFORMED, message_type, read_header
from prefill_worker.ingress.messages import (
    MAX_REQUEST_ID_CHARS,
    Abort,
    Drain,
    Ping,
    Prefill,
    Reject,
    RejectCode,
    RouterMessage,
    Sampling,
    TraceContextField,
    unpack_tokens,
)
from prefill_worker.request import AbortRequest, PrefillRequest, SamplingParams, TraceContext

_SMALL_PROMPT = 64  # below this, a Python min/max beats numpy's call overhead
_NEEDS_SWAP = sys.byteorder != "little"  # token_ids travel little-endian
_GREEDY = SamplingParams()
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")
_router_decoder = msgspec.msgpack.Decoder(RouterMessage)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a prompt must satisfy; ``max_pool_tokens`` is the whole KV pool in tokens.
    ``ttft_slo_s`` is read by the fronts' admission, not by the decoding here."""

    vocab_size: int
    max_prompt_tokens: int
    max_pool_tokens: int
    ttft_slo_s: float | None = None  # admission.ttft_slo_s: None admits whatever it predicts


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
    the request once rather than copying it with another id). The cost is linear in the
    frame's size and small: ``token_ids`` is copied once and range-checked by numpy."""
    raws = read_header(frame)
    if raws is None:
        return Reject(code=RejectCode.MALFORMED, message=MALFORMED)
    type_ = message_type(raws)
    if isinstance(type_, Reject):
        return type_
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


def _decode_typed(frame: bytes | memoryview) -> RouterMessage:
    try:
        return _router_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None
    except (msgspec.DecodeError, RecursionError):  # a value deeper down is not valid msgpack
        raise _Invalid(RejectCode.MALFORMED, None, MALFORMED) from None


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
        _trace_context(msg.trace_context),
    )


def _trace_context(field: TraceContextField | UnsetType | None) -> TraceContext | None:
    if not isinstance(field, TraceContextField):
        return None
    state = field.tracestate if isinstance(field.tracestate, str) else None
    return TraceContext(field.traceparent, state)


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
