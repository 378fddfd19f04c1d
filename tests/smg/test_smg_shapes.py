"""What smg 1.13 forwards of SGLang's ``/generate`` shapes that the worker's HTTP front accepts
(``docs/http-api.md``, "Through smg"). These tests pin smg's real behaviour, so that a smg
that changes it is noticed (and the doc is then changed with it):

- a batch of ``text`` and a ``logprob_start_len`` list (per prompt, or one in a list) are
  refused by smg itself with 422, before any server sees them;
- a batch of ``input_ids`` with ``return_logprob`` is served, but smg drops the prefill's
  ``input_token_logprobs`` (a single prompt gets them: ``test_smg_router.py``);
- ``stream: true`` (the decode answers in SSE, as an SGLang decode does) gets them merged
  into every chunk;
- ``meta_info`` comes from the decode's answer: ``cached_tokens`` is the prefix-cache hit the
  prefill wrote in the aux (SGLang: metadata) row, as SGLang's decode reports it."""

from __future__ import annotations

import threading
from typing import Any

from tests.checkpoints import prompt
from tests.smg.conftest import MODEL_NAME, Prefill, Stack, http, sse_events

NUM_NEW_TOKENS = 3


def body(ids: Any, **extra: object) -> dict[str, object]:
    params = {"temperature": 0, "max_new_tokens": NUM_NEW_TOKENS}
    return {"input_ids": ids, "sampling_params": params, **extra}


def test_what_smg_forwards_of_the_generate_shapes(stack: Stack) -> None:
    prefill = stack.start_prefill()
    stack.start_decode()
    stack.start_router()
    ids, other = prompt(13, seed=130), prompt(9, seed=131)

    refused = [
        {"text": ["a batch", "of text"], "sampling_params": {"max_new_tokens": 3}},
        body([ids, other], return_logprob=True, logprob_start_len=[0, 2]),
        body(ids, return_logprob=True, logprob_start_len=[0]),
    ]
    for shape in refused:
        status, answer = stack.generate(shape)
        assert status == 422, (shape, answer)  # smg's own JSON schema: never forwarded
    assert _num_requests(prefill) == 0

    logprobs = {"return_logprob": True, "logprob_start_len": 0}
    status, batch = stack.generate(body([ids, other], **logprobs))
    assert status == 200, batch
    assert [item["output_ids"] for item in batch] == [_greedy(stack, ids), _greedy(stack, other)]
    assert [item["meta_info"]["input_token_logprobs"] for item in batch] == [[], []]  # dropped
    # ... though the prefill computed them: asked directly, it answers them.
    direct = _direct(stack, prefill, [ids, other], 901, **logprobs)
    assert [len(item["meta_info"]["input_token_logprobs"]) for item in direct] == [13, 9]

    status, streamed = stack.generate(body(ids, stream=True, **logprobs))
    assert status == 200, streamed
    status, single = stack.generate(body(ids, **logprobs))
    assert status == 200 and len(single["meta_info"]["input_token_logprobs"]) == 13, single
    # An SSE stream (as an SGLang decode answers) gets them merged into every chunk.
    chunks = [e for e in sse_events(streamed) if isinstance(e, dict)]
    assert len(chunks) == NUM_NEW_TOKENS, streamed
    for chunk in chunks:
        assert (
            chunk["meta_info"]["input_token_logprobs"]
            == (single["meta_info"]["input_token_logprobs"])
        )

    first = prompt(23, seed=232)  # 5 full pages (page size 4) enter the prefill's cache
    cached = []
    for shape in (first, first[:20] + prompt(9, seed=233)):
        status, answer = stack.generate(body(shape))
        assert status == 200, answer
        cached.append(answer["meta_info"]["cached_tokens"])
    assert cached == [0, 20]


def _num_requests(prefill: Prefill) -> float:
    return prefill.metric("prefill_worker_requests_total")


def _greedy(stack: Stack, ids: list[int]) -> list[int]:
    status, answer = stack.generate(body(ids))
    assert status == 200, answer
    return list(answer["output_ids"])


def _direct(
    stack: Stack, prefill: Prefill, batch: list[list[int]], room: int, **extra: object
) -> Any:
    """The batch sent to the prefill and to the decode as smg would, rooms of our choosing."""
    rooms = [room, room + 1]
    where = {"bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [prefill.bootstrap_port] * 2}
    shaped = {**body(batch, **extra), **where, "bootstrap_room": rooms}
    shaped["model"] = MODEL_NAME
    decoded: list[object] = []
    decoding = threading.Thread(target=lambda: decoded.append(http(stack.decode_url, shaped)))
    decoding.start()
    status, answer = http(f"{prefill.url}/generate", shaped)
    decoding.join(60)
    assert status == 200, answer
    return answer
