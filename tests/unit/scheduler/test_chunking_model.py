"""Chunk ends and logprob positions against naive models: every (start, prompt, limit, page
size), including the exact boundaries (a prompt that just fits, a limit of one page)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefill_worker.scheduler.chunking import chunk_end, logprob_positions


@given(
    page_size=st.integers(1, 8),
    start_pages=st.integers(0, 6),
    rest=st.integers(1, 60),
    limit=st.integers(0, 64),
)
def test_a_chunk_ends_the_prompt_or_on_the_last_page_boundary_within_the_limit(
    page_size: int, start_pages: int, rest: int, limit: int
) -> None:
    start = start_pages * page_size
    num_tokens = start + rest
    ends = [num_tokens] if rest <= limit else []
    ends += [e for e in range(start + page_size, num_tokens, page_size) if e - start <= limit]
    assert chunk_end(start, num_tokens, limit, page_size) == (max(ends) if ends else None)


@given(
    logprob_start=st.one_of(st.none(), st.integers(0, 40)),
    start=st.integers(0, 40),
    size=st.integers(1, 20),
    extra=st.integers(0, 10),
)
def test_a_chunk_scores_its_positions_from_the_start_up_to_the_last_but_one(
    logprob_start: int | None, start: int, size: int, extra: int
) -> None:
    end = start + size
    num_tokens = end + extra
    want = (
        []
        if logprob_start is None
        else [p for p in range(start, end) if logprob_start <= p < num_tokens - 1]
    )
    assert list(logprob_positions(logprob_start, start, end, num_tokens)) == want
