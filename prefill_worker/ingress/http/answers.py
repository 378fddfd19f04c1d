"""What the HTTP front answers: outcomes as SGLang's ``/generate`` and OpenAI's
``/v1/completions`` bodies, refusals as JSON errors, each with the status a PD router reads.

The router ends a prefill's part on any 2xx and reads the body only for
``meta_info.input_token_logprobs`` (prepended to the decode's): SGLang's prompt logprobs,
one ``[logprob, token_id, text]`` entry per prompt token from ``logprob_start_len`` on
(docs/http-api.md, "Logprobs"). The status codes and what the router does with each are
tabled in docs/http-api.md ("Status codes"): 200 the KV and first token are in the decode's
pages, 400 no retry, 429 and 503 retried elsewhere, 500 retried with a new room.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefill_worker.ingress.http.text import TextCodec
from prefill_worker.request import FinishReason, Outcome

_STATUS = {
    FinishReason.OK: 200,
    FinishReason.DRAINING: 503,
    FinishReason.PROMPT_TOO_LONG: 400,
}
_FAILED = 500


@dataclass(frozen=True, slots=True)
class Asked:
    """What the client asked of one prompt that shapes its answer. ``scored_ids`` are the
    prompt's tokens from ``logprob_start_len`` on (empty when it asked for no prompt
    logprobs): the tokens of ``input_token_logprobs``."""

    return_logprob: bool
    rid: str | None = None
    return_text_in_logprobs: bool = False
    scored_ids: Sequence[int] = ()


def error_body(status: int, message: str, code: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "status": status}}


def status_of(outcomes: Sequence[Outcome]) -> int:
    """200 when every prompt succeeded, else the status of the first that did not."""
    for outcome in outcomes:
        status = _STATUS.get(outcome.reason, _FAILED)
        if status != 200:
            return status
    return 200


def failure_body(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    failed = next(o for o in outcomes if o.reason is not FinishReason.OK)
    message = f"prefill {failed.reason.value}: {failed.error or failed.reason.value}"
    return error_body(status_of(outcomes), message, failed.reason.value)


def generate_body(
    outcomes: Sequence[Outcome], asked: Sequence[Asked], codec: TextCodec | None, batch: bool
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's ``/generate`` answer (a list for a batch): the first token, as SGLang's own
    prefill server reports it (``finish_reason`` length 0)."""
    items = [_generated(o, a, codec) for o, a in zip(outcomes, asked, strict=True)]
    return items if batch else items[0]


def _generated(outcome: Outcome, asked: Asked, codec: TextCodec | None) -> dict[str, Any]:
    token = outcome.first_token_id
    assert token is not None, "only successful outcomes are answered with a body"
    t = outcome.timings
    meta: dict[str, Any] = {
        "id": asked.rid or uuid.uuid4().hex,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": outcome.num_prompt_tokens,
        "completion_tokens": 1,
        # SGLang's prefill (and its decode, off the metadata row) report the prefix cache's
        # hit here; the prefix a native decode held is not SGLang's notion
        "cached_tokens": outcome.num_prefix_hit_tokens,
        "e2e_latency": t.queue_s + t.bootstrap_s + t.prefill_s + t.transfer_s,
    }
    if asked.return_logprob:
        texts = codec if asked.return_text_in_logprobs else None
        meta["input_token_logprobs"] = _input_logprobs(outcome, asked.scored_ids, texts)
        meta["output_token_logprobs"] = _entries([outcome.first_token_logprob], [token], texts)
    return {"text": _text(codec, token), "output_ids": [token], "meta_info": meta}


def _input_logprobs(
    outcome: Outcome, scored_ids: Sequence[int], texts: TextCodec | None
) -> list[list[Any]]:
    """SGLang's ``input_token_logprobs``: tokens ``[start, n)``, the first without a logprob
    (``[]`` when the request asked for none, or from the prompt's end)."""
    if not scored_ids:
        return []
    return _entries([None, *(outcome.prompt_logprobs or ())], scored_ids, texts)


def _entries(
    logprobs: Sequence[float | None], token_ids: Sequence[int], texts: TextCodec | None
) -> list[list[Any]]:
    """``[logprob, token_id, text]`` per token; ``text`` is None without a codec."""
    words = [texts.decode([t]) for t in token_ids] if texts else [None] * len(token_ids)
    return [[lp, int(t), w] for lp, t, w in zip(logprobs, token_ids, words, strict=True)]


def completion_body(
    outcomes: Sequence[Outcome], asked: Sequence[Asked], codec: TextCodec | None, model: str
) -> dict[str, Any]:
    """OpenAI's ``text_completion`` with one choice per prompt: the first token."""
    choices = []
    for index, (outcome, wants) in enumerate(zip(outcomes, asked, strict=True)):
        token = outcome.first_token_id
        assert token is not None, "only successful outcomes are answered with a body"
        text = _text(codec, token)
        logprobs = None
        if wants.return_logprob:
            logprobs = {
                "tokens": [text],
                "token_logprobs": [outcome.first_token_logprob],
                "top_logprobs": [],
                "text_offset": [0],
            }
        choices.append(
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": "length"}
        )
    num_prompt = sum(o.num_prompt_tokens for o in outcomes)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": len(outcomes),
            "total_tokens": num_prompt + len(outcomes),
        },
    }


def _text(codec: TextCodec | None, token: int) -> str:
    return codec.decode([token]) if codec is not None else ""
