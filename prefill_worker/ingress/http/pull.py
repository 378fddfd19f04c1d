"""The HTTP front's part in vLLM pulls: a prompt marked ``is_pull`` (``bodies``) has its room
opened as a ticket before it enters the engine, and its answer carries the
``kv_transfer_params`` the vLLM backend recorded once the KV was staged (``transfer.vllm``:
``tickets`` says the whole exchange). A worker that does not serve vLLM decodes refuses such a
request with 400 rather than answering without params (the proxy would send the decode a
request it cannot serve), and so does one that names a vLLM version (``vllm_version``) this
worker does not serve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefill_worker.ingress.http.bodies import BadRequest, Prompt
from prefill_worker.transfer.vllm.profiles import why_unserved
from prefill_worker.transfer.vllm.tickets import Tickets


def open_pulls(tickets: Tickets | None, prompts: Sequence[Prompt]) -> None:
    """Open a ticket per pull prompt; ``BadRequest`` (400, or 429 when too many are open)
    when they cannot be served. Nothing stays open on failure."""
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
    for index, prompt in enumerate(pulls):
        if not tickets.open(prompt.bootstrap_room, prompt.vllm_version):
            close_pulls(tickets, pulls[:index])
            raise BadRequest("too many vLLM pulls in flight", "overloaded", status=429)


def close_pulls(
    tickets: Tickets | None, prompts: Sequence[Prompt]
) -> list[Mapping[str, Any] | None]:
    """Close the pull prompts' tickets: the params each ended with (None for a prompt that is
    not a pull, or whose KV was never staged)."""
    if tickets is None:
        return [None] * len(prompts)
    return [tickets.take(p.bootstrap_room) if p.is_pull else None for p in prompts]
