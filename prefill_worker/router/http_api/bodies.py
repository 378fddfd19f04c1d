"""What SGLang's router POSTs: the ``/generate`` and ``/v1/completions`` bodies as msgspec
Structs, and their reading into one ``Prompt`` per prompt of the request.

The router forwards the client's body and adds ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` (lists, one per prompt, for a batch) and flags such as ``model`` or
``log_metrics``; unknown keys are ignored, as SGLang's own server does with the router's flags.
Reading is strict about what changes the first token: a sampling option this worker does not
apply (``min_p``, ``logit_bias``, grammars, ``n > 1``, ``min_new_tokens``) is a ``BadRequest``,
never silently dropped. Options that only concern later tokens (``max_new_tokens``, ``stop``,
penalties on generated tokens) are the decode's and are ignored here. Nothing here knows
tokenizers or the model's limits: that is ``admit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from prefill_worker.request import SamplingParams

IntOrList = int | list[int] | None


class BadRequest(ValueError):
    """The request cannot be served as asked: answered with HTTP 400, naming the field."""

    def __init__(self, message: str, code: str = "bad_field") -> None:
        super().__init__(message)
        self.code = code  # a reject code (router/messages.py RejectCode values), for metrics


class SglSampling(msgspec.Struct, forbid_unknown_fields=False):
    """SGLang's ``sampling_params``, the fields that can change the first token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # SGLang: -1 (or 0 here) disables top-k
    min_p: float = 0.0
    sampling_seed: int | None = None
    n: int = 1
    min_new_tokens: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None


class GenerateBody(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /generate``: ``text`` or ``input_ids``, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # ints, or lists of ints (checked by _as_batch)
    sampling_params: SglSampling | list[SglSampling] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: IntOrList = None
    top_logprobs_num: IntOrList = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    bootstrap_room: IntOrList = None


class CompletionBody(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /v1/completions`` (OpenAI's, with SGLang's ``top_k``)."""

    prompt: str | list[Any]  # text, texts, ids, or lists of ids (checked by _as_batch)
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    logit_bias: dict[str, float] | None = None
    bootstrap_room: IntOrList = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a request: ids, or text for the tokenizer. ``logprob_start_len`` is
    SGLang's, as sent (None when absent, or when ``return_logprob`` is off, which makes SGLang
    ignore it); ``admit.py`` checks it against the prompt's length."""

    token_ids: list[int] | None
    text: str | None
    sampling: SamplingParams
    return_logprob: bool
    bootstrap_room: int
    rid: str | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False


_generate = msgspec.json.Decoder(GenerateBody)
_completion = msgspec.json.Decoder(CompletionBody)


def read_generate(body: bytes) -> tuple[list[Prompt], bool]:
    """The prompts, and whether they came as a batch (the answer is then a list)."""
    req = _decode(_generate, body)
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("give exactly one of text and input_ids", "missing_field")
    value = req.input_ids if req.input_ids is not None else req.text or ""
    items = _as_batch(value)
    n = len(items)
    rooms = _per_prompt("bootstrap_room", req.bootstrap_room, n, required=True)
    params = _per_prompt("sampling_params", req.sampling_params, n) or [None] * n
    logprob = _per_prompt("return_logprob", req.return_logprob, n)
    starts = _per_prompt("logprob_start_len", req.logprob_start_len, n) or [None] * n
    rids = _per_prompt("rid", req.rid, n) or [None] * n
    if req.top_logprobs_num not in (None, 0) and any(logprob):
        raise BadRequest("top_logprobs_num is not supported by this prefill worker")
    prompts = [
        Prompt(
            item if isinstance(item, list) else None,
            item if isinstance(item, str) else None,
            _sampling(params[i] or SglSampling()),
            logprob[i],
            rooms[i],
            rids[i],
            starts[i] if logprob[i] else None,
            req.return_text_in_logprobs,
        )
        for i, item in enumerate(items)
    ]
    return prompts, is_batch(value)


def is_batch(value: str | list[Any]) -> bool:
    """A list of texts or of id lists (one prompt is a text or a list of ids)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], (list, str))


def read_completion(body: bytes) -> list[Prompt]:
    req = _decode(_completion, body)
    if req.echo:
        raise BadRequest("echo is not supported by this prefill worker")
    if req.n != 1:
        raise BadRequest("n > 1 is not supported by this prefill worker", "bad_sampling")
    items = _as_batch(req.prompt)
    rooms = _per_prompt("bootstrap_room", req.bootstrap_room, len(items), required=True)
    sampling = _sampling(
        SglSampling(req.temperature, req.top_p, req.top_k, req.min_p, req.seed, 1, 0)
    )
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by this prefill worker", "bad_sampling")
    return [
        Prompt(
            item if isinstance(item, list) else None,
            item if isinstance(item, str) else None,
            sampling,
            req.logprobs is not None,
            room,
        )
        for item, room in zip(items, rooms, strict=True)
    ]


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"bad request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}", "malformed") from None


def _as_batch(value: str | list[Any]) -> list[str | list[int]]:
    """One prompt (a string, a list of ids) as a batch of one; a batch (of strings, or of
    lists of ids) as it is. JSON booleans are not token ids."""
    if isinstance(value, str):
        return [value]
    if not is_batch(value):
        return [_ids(value)]
    if all(isinstance(item, str) for item in value):
        return list(value)
    return [_ids(item) for item in value]


def _ids(value: object) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise BadRequest("a prompt must be text, or a list of integer token ids")
    return value


def _per_prompt(name: str, value: Any, n: int, required: bool = False) -> list[Any]:
    """A field given once for the batch or once per prompt, as one value per prompt."""
    if value is None:
        if required:
            why = f"{name} is required: this worker is a prefill server, driven by a PD router"
            raise BadRequest(why, "missing_field")
        return []
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
    return value


def _sampling(p: SglSampling) -> SamplingParams:
    """SGLang's sampling options as the worker's first-token ``SamplingParams``."""
    unsupported = {
        "json_schema": p.json_schema is not None,
        "regex": p.regex is not None,
        "ebnf": p.ebnf is not None,
        "structural_tag": p.structural_tag is not None,
        "logit_bias": bool(p.logit_bias),
        "min_p": p.min_p > 0.0,
        "min_new_tokens": p.min_new_tokens > 0,
        "n": p.n != 1,
    }
    for name, is_set in unsupported.items():
        if is_set:
            why = f"sampling_params.{name} is not supported by this prefill worker"
            raise BadRequest(why, "bad_sampling")
    if p.top_k < -1:
        raise BadRequest("sampling_params.top_k must be -1 (off) or >= 0", "bad_sampling")
    params = SamplingParams(p.temperature, p.top_p, max(p.top_k, 0), p.sampling_seed)
    problem = params.problem()
    if problem is not None:
        field, why = problem
        raise BadRequest(f"{field.replace('sampling.', 'sampling_params.')} {why}", "bad_sampling")
    return params
