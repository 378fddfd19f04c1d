"""The HTTP front's part in vLLM pulls: a prompt marked ``is_pull`` (``bodies``) has its room
opened as a ticket before it enters the engine, and its answer carries the
``kv_transfer_params`` the vLLM backend recorded once the KV was staged (``transfer.vllm``:
``tickets`` says the whole exchange). A worker that does not serve vLLM decodes refuses such a
request with 400 rather than answering without params (the proxy would send the decode a
request it cannot serve), and so does one that names a vLLM version (``vllm_version``) this
worker does not serve, or one whose decode cannot read this model (``Tickets.why_refused``: a
sliding-window model to vLLM 0.33 or push mode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from prefill_worker.ingress.http.bodies import BadRequest, Prompt
from prefill_worker.request import PrefillRequest
from prefill_worker.transfer.vllm.profiles import PULL, TRANSFER_MODES, why_unserved
from prefill_worker.transfer.vllm.push import push_key
from prefill_worker.transfer.vllm.tickets import Tickets


def open_pulls(
    tickets: Tickets | None, prompts: Sequence[Prompt], header_id: str | None = None
) -> None:
    """Open a ticket per pull prompt; ``BadRequest`` (400, or 429 when too many are open)
    when they cannot be served. Nothing stays open on failure. ``header_id``: the request's
    ``X-Request-Id`` (a push decode's registration names the id vLLM derives from it)."""
    pulls = [p for p in prompts if p.is_pull]
    if not pulls:
        return
    if tickets is None:
        why = "kv_transfer_params: this worker does not serve vLLM decodes (transfer.protocol)"
        raise BadRequest(why, "bad_field")
    for prompt in pulls:
        unserved = prompt.vllm_version and why_unserved(prompt.vllm_version, tickets.versions)
        if unserved:
            raise BadRequest(f"kv_transfer_params.vllm_version: {unserved}", "bad_field")
        refused = tickets.why_refused(prompt.vllm_version, prompt.vllm_mode or PULL)
        if refused:
            raise BadRequest(f"kv_transfer_params: {refused}", "bad_field")
    keys = [_push_key(tickets, p, header_id) for p in pulls]
    for index, (prompt, key) in enumerate(zip(pulls, keys, strict=True)):
        mode = prompt.vllm_mode or PULL
        if not tickets.open(prompt.bootstrap_room, prompt.vllm_version, mode, key):
            close_pulls(tickets, pulls[:index])
            raise BadRequest("too many vLLM pulls in flight", "overloaded", status=429)


def trim_pulls(
    tickets: Tickets | None, prompts: Sequence[Prompt], requests: list[PrefillRequest]
) -> list[PrefillRequest]:
    """The engine's requests, each pull's prompt cut ``tickets.prompt_backoff`` tokens short
    when it is longer (a linear-attention model: vLLM's decode loads the KV and state of all
    but its last token and computes that one itself, as vLLM's own prefill leaves it)."""
    backoff = 0 if tickets is None else tickets.prompt_backoff
    if not backoff:
        return requests
    return [
        _trimmed(r, backoff) if p.is_pull else r for p, r in zip(prompts, requests, strict=True)
    ]


def _trimmed(request: PrefillRequest, backoff: int) -> PrefillRequest:
    num_tokens = len(request.token_ids)
    if num_tokens <= backoff:
        return request
    start = request.prompt_logprob_start
    start = None if start is None else min(start, num_tokens - backoff)
    tokens = request.token_ids[: num_tokens - backoff]
    return dataclasses.replace(request, token_ids=tokens, prompt_logprob_start=start)


def _push_key(tickets: Tickets, prompt: Prompt, header_id: str | None) -> str | None:
    """A push prompt's ``push.push_key`` (None for a pull); ``BadRequest`` when the mode is
    not served or no request id names the decode's registration."""
    mode = prompt.vllm_mode or PULL
    if mode not in TRANSFER_MODES or mode not in tickets.modes:
        served = ", ".join(tickets.modes)
        why = f"kv_transfer_params.transfer_mode: {mode!r}; this worker serves {served}"
        raise BadRequest(why, "bad_field")
    if mode == PULL:
        return None
    external = header_id or prompt.request_id
    if not external:
        why = (
            "a vLLM push matches the decode's registration by request id: send X-Request-Id "
            "(as vLLM's proxy does) or request_id"
        )
        raise BadRequest(why, "missing_field")
    return push_key(external)


def close_pulls(
    tickets: Tickets | None, prompts: Sequence[Prompt]
) -> list[Mapping[str, Any] | None]:
    """Close the pull prompts' tickets: the params each ended with (None for a prompt that is
    not a pull, or whose KV was never staged)."""
    if tickets is None:
        return [None] * len(prompts)
    return [tickets.take(p.bootstrap_room) if p.is_pull else None for p in prompts]
