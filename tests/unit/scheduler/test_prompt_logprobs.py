"""Prompt logprobs through the engine (fake runner: each scored position reports
``fake_logprob(position, token)`` and checks the token is the prompt's next one): which
positions each chunk scores across chunk boundaries, the prefix cache capped at the start,
requests that do not ask, and the fault paths (pools whole, no logprobs reported)."""

from __future__ import annotations

import pytest

from prefill_worker.request import FinishReason
from prefill_worker.scheduler.chunking import logprob_positions
from tests.unit.scheduler.fakes import expected_token, fake_logprob, make_rig

PS = 4


def expected(tokens: list[int], start: int) -> tuple[float, ...]:
    """Tokens [start + 1, n), each scored by the position before it."""
    return tuple(fake_logprob(p, tokens[p + 1]) for p in range(start, len(tokens) - 1))


@pytest.mark.parametrize(
    ("start", "chunk", "n", "want"),
    [
        (None, (0, 8), 20, range(0)),
        (0, (0, 8), 20, range(0, 8)),
        (5, (0, 8), 20, range(5, 8)),
        (9, (0, 8), 20, range(0)),  # all of it before the start
        (8, (8, 16), 20, range(8, 16)),  # the chunk's first position scores token 9
        (3, (16, 20), 20, range(16, 19)),  # the last position samples, it scores nothing
        (19, (16, 20), 20, range(0)),
        (20, (16, 20), 20, range(0)),
    ],
)
def test_the_positions_a_chunk_scores(
    start: int | None, chunk: tuple[int, int], n: int, want: range
) -> None:
    got = logprob_positions(start, *chunk, n)
    assert list(got) == list(want)


@pytest.mark.parametrize("overlap", [False, True])
def test_chunks_assemble_each_prompt_token_once(overlap: bool) -> None:
    """chunk 8, budget 16 (two requests per batch), starts on and off chunk boundaries."""
    rig = make_rig(page_size=PS, chunk_size=8, max_batch_tokens=16, overlap=overlap)
    starts = {"s0": 0, "s5": 5, "s8": 8, "s16": 16, "s28": 28, "s29": 29, "s30": 30}
    for request_id, start in starts.items():
        rig.prefill(request_id, 30, prompt_logprob_start=start)
    rig.prefill("unasked", 30)  # return_logprob, no start: no prompt logprobs
    rig.prefill("off", 30, return_logprob=False, prompt_logprob_start=0)  # ignored, as SGLang
    rig.run_until_idle()
    for request_id, start in starts.items():
        out, tokens = rig.outcome(request_id), list(rig.messages[request_id].token_ids)
        assert out.reason is FinishReason.OK and out.first_token_id == expected_token(tokens)
        assert out.prompt_logprobs == expected(tokens, start), request_id
    assert rig.outcome("unasked").prompt_logprobs is None
    assert rig.outcome("off").prompt_logprobs is None
    asked = {c.request_id for p in rig.runner.plans for c in p.chunks if c.logprob_token_ids}
    assert asked == set(starts) - {"s29", "s30"}  # nobody else's chunk scored anything
    rig.check_whole()


def test_the_prefix_cache_hit_stops_at_the_logprob_start() -> None:
    rig = make_rig(page_size=PS, chunk_size=8, max_batch_tokens=16, prefix_cache=True)
    warm = rig.prefill("warm", 30, return_logprob=False)
    rig.run_until_idle()  # 7 whole pages cached
    tokens = list(warm.token_ids)
    cases = {"at10": (10, 8), "at0": (0, 0), "at3": (3, 0), "at12": (12, 12), "at29": (29, 28)}
    for request_id, (start, _) in cases.items():
        rig.prefill(request_id, 30, token_ids=tokens, prompt_logprob_start=start)
        rig.runner.prompts[request_id] = tokens
        rig.run_until_idle()
    for request_id, (start, hit) in cases.items():
        out = rig.outcome(request_id)
        assert out.num_prefix_hit_tokens == hit, request_id  # page-aligned, at most the start
        assert out.prompt_logprobs == expected(tokens, start), request_id
    rig.check_whole()


def test_a_decode_held_prefix_is_still_scored() -> None:
    """The decode's prefix is not sent, but the worker computes it, so its logprobs are there."""
    rig = make_rig(page_size=PS, chunk_size=8, auto_want=False)
    msg = rig.prefill("held", 21, prompt_logprob_start=0)
    rig.sender("held").want(num_cached_tokens=8)
    rig.run_until_idle()
    out = rig.outcome("held")
    assert out.num_cached_tokens == 8
    assert out.prompt_logprobs == expected(list(msg.token_ids), 0)
    rig.check_whole()


@pytest.mark.parametrize("when", ["mid_prefill", "transferring"])
def test_a_request_that_ends_early_reports_no_logprobs(when: str) -> None:
    rig = make_rig(page_size=PS, chunk_size=8, max_batch_tokens=8, polls_to_success=None)
    rig.prefill("a", 30, prompt_logprob_start=0)
    rig.prefill("b", 30, prompt_logprob_start=2)
    rig.steps(2 if when == "mid_prefill" else 9)
    rig.abort("a")
    rig.sender("b").break_()
    rig.run_until_idle()
    for request_id, reason in (("a", FinishReason.ABORTED_BY_ROUTER), ("b", None)):
        out = rig.outcome(request_id)
        assert out.reason is not FinishReason.OK and (reason is None or out.reason is reason)
        assert out.prompt_logprobs is None
    rig.check_whole()


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_each_chunk_names_the_prompt_token_after_it(prefix_cache: bool) -> None:
    """``next_token_id`` (a draft's shifted input): the prompt token at the chunk's end, None
    on the chunk that ends the prompt; chunks after a prefix hit too."""
    rig = make_rig(page_size=PS, chunk_size=8, max_batch_tokens=16, prefix_cache=prefix_cache)
    warm = rig.prefill("warm", 30, return_logprob=False)
    rig.run_until_idle()
    rig.prefill("again", 30, token_ids=list(warm.token_ids), return_logprob=False)
    rig.run_until_idle()
    tokens = list(warm.token_ids)
    chunks = [c for p in rig.runner.plans for c in p.chunks]
    assert {c.request_id for c in chunks} == {"warm", "again"}
    for c in chunks:
        want = tokens[c.end] if c.end < len(tokens) else None
        assert c.next_token_id == want, (c.request_id, c.start, c.end)
    assert sum(c.next_token_id is None for c in chunks) == 2
    rig.check_whole()
