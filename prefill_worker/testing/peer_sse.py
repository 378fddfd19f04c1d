"""Server-sent events as an SGLang decode server streams them, for the reference decode peer's
HTTP face (``peer_http``): ``stream: true`` on ``/generate`` gives one ``data: {json}`` event
per generated token, each with the text and ``output_ids`` so far and the ``meta_info``
(``finish_reason`` null until the last), ``index`` per prompt of a batch, then
``data: [DONE]``; on ``/v1/completions``, OpenAI's ``text_completion`` chunks (the text's
delta per token). A test tool: the peer generates a request whole, so its events go out
together once it has finished (a router cannot tell).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web


async def send_events(request: web.Request, events: Iterator[Any]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for event in events:
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def generate_events(
    items: list[dict[str, Any]], text_of: Callable[[list[int]], str], is_batch: bool
) -> Iterator[dict[str, Any]]:
    """``items``: each prompt's whole answer (``text``, ``output_ids``, ``meta_info``)."""
    for index, item in enumerate(items):
        tokens: list[int] = item["output_ids"]
        for k in range(1, len(tokens) + 1):
            meta = dict(item["meta_info"], completion_tokens=k)
            if k < len(tokens):
                meta["finish_reason"] = None
            event = {"text": text_of(tokens[:k]), "output_ids": tokens[:k], "meta_info": meta}
            yield {**event, "index": index} if is_batch else event


def completion_events(
    texts: list[list[str]], model: str, request_id: str
) -> Iterator[dict[str, Any]]:
    """``texts``: each prompt's text after each token; a chunk carries the delta."""
    for index, steps in enumerate(texts):
        previous = ""
        for k, text in enumerate(steps):
            finish = "length" if k == len(steps) - 1 else None
            choice = {"index": index, "text": text[len(previous) :], "finish_reason": finish}
            previous = text
            yield {
                "id": request_id,
                "object": "text_completion",
                "model": model,
                "choices": [choice],
            }
