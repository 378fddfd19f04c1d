"""What SGLang's router POSTs: the ``/generate`` and ``/v1/completions`` bodies as msgspec
Structs, and their reading into one ``Prompt`` per prompt of the request.

The router forwards the client's body and adds ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` (lists, one per prompt, for a batch) and flags such as ``model``; unknown
keys are ignored, as SGLang's own server does. Reading is strict about what changes the first
token: a sampling option this worker does not apply (``min_p``, ``logit_bias``, grammars,
``n > 1``, ``min_new_tokens``) is a ``BadRequest``, never silently dropped; options that only
concern later tokens are the decode's and are ignored here. Nothing here knows tokenizers or
the model's limits: that is ``prompts.py``. Token ids stay JSON text (``msgspec.Raw``) until
``prompts.py`` has checked their size (what a hostile body may cost: docs/http-api.md). A
``/v1/completions`` body from vLLM's proxy carries ``kv_transfer_params.do_remote_decode``
and no room: its one prompt gets a random room and is marked ``is_pull`` (``pull.py``).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import msgspec

from prefill_worker.ingress.http.shape import ShapeRefused, check_shape
from prefill_worker.request import SamplingParams

IntOrList = int | list[int] | None
_FIRST_ITEM = re.compile(rb"\[\s*+(.)", re.DOTALL)  # the first byte of a list's first item
_ABSENT = (b"", b"null")


class BadRequest(ValueError):
    """The request cannot be served as asked: answered with HTTP ``status`` (400 unless said),
    naming the field."""

    def __init__(self, message: str, code: str = "bad_field", status: int = 400) -> None:
        super().__init__(message)
        self.code = code  # a reject code (RejectCode values, or "too_large"), for metrics
        self.status = status


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
    input_ids: msgspec.Raw = msgspec.Raw()  # ids, or lists of ids: read by _items, then admit
    sampling_params: SglSampling | list[SglSampling] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: IntOrList = None
    top_logprobs_num: IntOrList = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    bootstrap_room: IntOrList = None


class PullAsk(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's ``kv_transfer_params`` on a prefill request: its proxy (and llm-d's sidecar)
    send ``do_remote_decode`` true and the remote fields null."""

    do_remote_decode: bool = False
    # Not vLLM's: the version of vLLM the decode runs, for a router that knows it (a worker
    # serves each version on its own side channel); absent: the worker's default
    vllm_version: str | None = None
    # vLLM's: "push" when the decode runs vLLM's push connector (we WRITE into its blocks)
    transfer_mode: str | None = None


class CompletionBody(msgspec.Struct, forbid_unknown_fields=False):
    """``POST /v1/completions`` (OpenAI's, with SGLang's ``top_k`` and vLLM's
    ``kv_transfer_params``)."""

    prompt: msgspec.Raw  # text, texts, ids, or lists of ids (read by _items)
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
    kv_transfer_params: PullAsk | None = None
    request_id: str | None = None  # vLLM's: its id when no X-Request-Id header names one


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a request: ids (still JSON: ``prompts.py`` bounds, decodes and checks
    them), or text for the tokenizer. ``logprob_start_len`` is
    SGLang's, as sent (None when absent, or when ``return_logprob`` is off, which makes SGLang
    ignore it); ``prompts.py`` checks it against the prompt's length."""

    token_ids: msgspec.Raw | None
    text: str | None
    sampling: SamplingParams
    return_logprob: bool
    bootstrap_room: int
    rid: str | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False
    is_pull: bool = False  # a vLLM decode pulls its KV (the answer carries kv_transfer_params)
    vllm_version: str | None = None  # a pull's: the version its decode runs (None: default)
    vllm_mode: str | None = None  # a pull's: "push" when the decode is written to (None: pull)
    request_id: str | None = None  # the body's ``request_id`` (a push matches the decode by it)


_generate = msgspec.json.Decoder(GenerateBody)
_completion = msgspec.json.Decoder(CompletionBody)


def read_generate(body: bytes, max_prompts: int) -> tuple[list[Prompt], bool]:
    """The prompts, and whether they came as a batch (the answer is then a list). A batch of
    more than ``max_prompts`` is refused (429) before its prompts are read."""
    req = _decode(_generate, body, max_prompts)
    ids = None if bytes(req.input_ids) in _ABSENT else req.input_ids
    if (req.text is None) == (ids is None):
        raise BadRequest("give exactly one of text and input_ids", "missing_field")
    if ids is not None:
        items, batch = _items(ids, max_prompts)
        if any(isinstance(item, str) for item in items):
            raise BadRequest("input_ids must be integer token ids (text goes in text)")
    else:
        batch = isinstance(req.text, list)
        items = list(req.text) if isinstance(req.text, list) else [req.text or ""]
        _check_count(len(items), max_prompts)
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
            None if isinstance(item, str) else item,
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
    return prompts, batch


def read_completion(body: bytes, max_prompts: int) -> list[Prompt]:
    req = _decode(_completion, body, max_prompts)
    if req.echo:
        raise BadRequest("echo is not supported by this prefill worker")
    if req.n != 1:
        raise BadRequest("n > 1 is not supported by this prefill worker", "bad_sampling")
    items, _ = _items(req.prompt, max_prompts)
    ask = req.kv_transfer_params
    is_pull = ask is not None and ask.do_remote_decode
    version = ask.vllm_version if ask is not None and is_pull else None
    mode = ask.transfer_mode if ask is not None and is_pull else None
    if is_pull and len(items) != 1:
        raise BadRequest("kv_transfer_params (a vLLM pull) takes one prompt, not a batch")
    if is_pull and req.bootstrap_room is not None:  # a room is one request's, of one protocol
        raise BadRequest("bootstrap_room: a vLLM pull names none (the worker draws its room)")
    if is_pull:
        rooms = [secrets.randbits(63)]  # no decode names it: a fresh capability per request
    else:
        rooms = _per_prompt("bootstrap_room", req.bootstrap_room, len(items), required=True)
    sampling = _sampling(
        SglSampling(req.temperature, req.top_p, req.top_k, req.min_p, req.seed, 1, 0)
    )
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by this prefill worker", "bad_sampling")
    return [
        Prompt(
            None if isinstance(item, str) else item,
            item if isinstance(item, str) else None,
            sampling,
            req.logprobs is not None,
            room,
            is_pull=is_pull,
            vllm_version=version,
            vllm_mode=mode,
            request_id=req.request_id,
        )
        for item, room in zip(items, rooms, strict=True)
    ]


def max_values(max_prompts: int) -> int:
    """Strings, arrays and objects a body of ``max_prompts`` prompts may hold: a few per
    prompt (its ids or text, sampling options, rid, stop strings) and some to spare."""
    return 8 * max_prompts + 1024


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes, max_prompts: int) -> Any:
    try:
        check_shape(body, max_values(max_prompts))
        return decoder.decode(body)
    except ShapeRefused as exc:
        raise BadRequest(str(exc), exc.code, exc.status) from None
    except msgspec.ValidationError as exc:
        raise BadRequest(f"bad request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}", "malformed") from None


def _items(value: msgspec.Raw, max_prompts: int) -> tuple[list[str | msgspec.Raw], bool]:
    """The prompts of a ``prompt`` or ``input_ids`` field, and whether it is a batch: texts
    decoded, id lists still JSON. One prompt is a text or a list of ids; a batch is a list of
    texts or of id lists. Only the outer list is decoded, after its length is checked."""
    if bytes(memoryview(value)[:1]) == b'"':
        return [_part(str, value)], False
    first = _FIRST_ITEM.match(value)
    if first is None:
        raise BadRequest("a prompt must be text, or a list of integer token ids")
    if first.group(1) not in (b'"', b"["):
        return [value], False  # one list of ids (or an empty list, refused by admit)
    kind = list[str] if first.group(1) == b'"' else list[msgspec.Raw]
    items: list[str | msgspec.Raw] = list(_part(kind, value))  # as many as check_shape let by
    _check_count(len(items), max_prompts)
    return items, True


def _check_count(num_prompts: int, max_prompts: int) -> None:
    if num_prompts > max_prompts:
        why = f"a batch of {num_prompts} prompts; this front holds at most {max_prompts}"
        raise BadRequest(why, "overloaded", status=429)
    if not num_prompts:
        raise BadRequest("an empty batch", "empty_prompt")


def _part(kind: Any, value: msgspec.Raw) -> Any:
    try:
        return msgspec.json.decode(value, type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"a prompt must be text, or a list of integer token ids: {exc}") from None


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
