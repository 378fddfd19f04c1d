"""From the HTTP front's ``Prompt`` to the engine's ``PrefillRequest``, or a ``BadRequest``.

Text is tokenized here; the prompt then goes through the same checks as a ZMQ ``prefill``
frame (``ingress.validate.check_token_ids``: length, vocabulary, pool size;
``check_logprob_start``: where prompt logprobs may start), so both ingresses share one owner
of what a valid prompt is. What a prompt may cost is bounded before it is built: its ids' JSON
by ``max_prompt_tokens`` × ``_ID_BYTES``, its text by ``max_prompt_tokens`` × the longest token
in the vocabulary (a longer text cannot fit: a byte-level tokenizer puts each byte of the text
in one token), so a 60 MB id list or text is refused in microseconds. ``admit`` may run off
the event loop (``server.py`` runs it on its executor for texts and big bodies). Ids are the
front's own (``http:<n>``): a ZMQ ingress id is ``<hex>/<id>``, so the two never meet and the
daemon routes each outcome back by prefix (``is_front_id``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import msgspec

from prefill_worker.ingress.http.bodies import BadRequest, Prompt
from prefill_worker.ingress.http.text import TextCodec
from prefill_worker.ingress.validate import (
    Limits,
    PromptRefused,
    check_logprob_start,
    check_token_ids,
)
from prefill_worker.request import PrefillRequest, TraceContext

ID_PREFIX = "http:"
_MAX_ROOM = 2**63
_ID_BYTES = 24  # JSON bytes per token id: six digits, a comma, pretty-printing's indentation
_ids = msgspec.json.Decoder(list[int])
# W3C trace context headers longer than these are not passed on (a traceparent is 55 chars;
# tracestate's 32 entries fit in 512 as the recommendation asks of those who propagate it).
MAX_TRACEPARENT_CHARS = 256
MAX_TRACESTATE_CHARS = 512


def trace_context_of(headers: Mapping[str, str]) -> TraceContext | None:
    """The router's W3C ``traceparent``/``tracestate`` (smg sends them with
    ``--enable-trace``), or None when absent or oversized; the tracer judges the format."""
    parent = headers.get("traceparent")
    if not parent or len(parent) > MAX_TRACEPARENT_CHARS:
        return None
    state = headers.get("tracestate")
    if state is not None and len(state) > MAX_TRACESTATE_CHARS:
        state = None
    return TraceContext(parent, state)


def is_front_id(request_id: str) -> bool:
    """Whether an engine request id belongs to the HTTP front (else to the ZMQ ingress)."""
    return request_id.startswith(ID_PREFIX)


class Admitter:
    """Numbers, tokenizes and checks prompts; thread-safe (``next`` on a count is atomic)."""

    def __init__(self, limits: Limits, codec: TextCodec | None) -> None:
        self._limits = limits
        self._codec = codec
        self._serial = itertools.count()
        self._max_ids_bytes = limits.max_prompt_tokens * _ID_BYTES + 64
        self._max_text_bytes = limits.max_prompt_tokens * (codec.max_token_bytes if codec else 0)

    def admit(
        self, prompts: list[Prompt], arrival_time: float, trace: TraceContext | None = None
    ) -> list[PrefillRequest]:
        """Every prompt as a request, or ``BadRequest`` for the first that is not valid;
        ``trace`` is the HTTP request's trace context, shared by its prompts."""
        return [self._one(i, prompt, arrival_time, trace) for i, prompt in enumerate(prompts)]

    def _one(
        self, index: int, prompt: Prompt, arrival_time: float, trace: TraceContext | None
    ) -> PrefillRequest:
        where = f"prompt {index}: " if index else ""
        if not 0 <= prompt.bootstrap_room < _MAX_ROOM:
            raise BadRequest(f"{where}bootstrap_room must be in [0, 2**63)")
        if prompt.return_text_in_logprobs and prompt.return_logprob and self._codec is None:
            why = "return_text_in_logprobs needs a tokenizer; this worker's model has none"
            raise BadRequest(why, "bad_field")
        try:
            tokens = check_token_ids(self._token_ids(prompt), self._limits)
            start = check_logprob_start(prompt.logprob_start_len, len(tokens))
        except PromptRefused as exc:
            raise BadRequest(f"{where}{exc}", exc.code.value) from None
        return PrefillRequest(
            f"{ID_PREFIX}{next(self._serial)}",
            tokens,
            prompt.sampling,
            prompt.return_logprob,
            prompt.bootstrap_room,
            arrival_time,
            prompt_logprob_start=start,
            trace_context=trace,
        )

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            return self._decode_ids(prompt.token_ids)
        if self._codec is None:
            raise BadRequest("this worker's model has no tokenizer: send input_ids", "bad_field")
        text = prompt.text or ""
        if len(text) > self._max_text_bytes or len(text.encode()) > self._max_text_bytes:
            why = (
                f"a text of more than {self._max_text_bytes} bytes cannot fit in "
                f"{self._limits.max_prompt_tokens} tokens"
            )
            raise BadRequest(why, "prompt_too_long")
        return self._codec.encode(text)

    def _decode_ids(self, raw: msgspec.Raw) -> list[int]:
        if len(raw) > self._max_ids_bytes:
            why = (
                f"input_ids take {len(raw)} bytes of JSON; a prompt of at most "
                f"{self._limits.max_prompt_tokens} tokens takes at most {self._max_ids_bytes}"
            )
            raise BadRequest(why, "prompt_too_long")
        try:
            return _ids.decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError too: "hello", 1.5, true
            raise BadRequest(f"input_ids must be integer token ids: {exc}", "bad_field") from None
