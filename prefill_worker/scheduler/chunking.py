"""Where the next prefill chunk of a prompt ends, and which of its positions give prompt
logprobs.

A chunk is at most ``limit`` tokens (the smaller of ``chunk_size`` and what is left of the
step's token budget). A chunk that does not finish the prompt ends on a page boundary, so the
pages it filled are complete and can be sent while the next chunk computes::

    page_size 16, chunk_size 40, prompt 100:  [0, 32) [32, 64) [64, 96) [96, 100)

A request asking for prompt logprobs from position ``s`` needs the logits of positions
``[s, n - 1)``: each scores the next prompt token (position ``n - 1`` samples the first token
instead). A chunk computes its share of them (``logprob_positions``).
"""

from __future__ import annotations


def chunk_end(start: int, num_tokens: int, limit: int, page_size: int) -> int | None:
    """End of the chunk from ``start`` (page-aligned), or None when none fits in ``limit``."""
    assert start % page_size == 0 and 0 <= start < num_tokens
    if num_tokens - start <= limit:
        return num_tokens
    aligned = limit - limit % page_size
    return start + aligned if aligned > 0 else None


def logprob_positions(logprob_start: int | None, start: int, end: int, num_tokens: int) -> range:
    """The positions of chunk ``[start, end)`` whose logits score the next prompt token for a
    request asking from ``logprob_start`` (None: it does not ask; the range is empty)."""
    if logprob_start is None:
        return range(0)
    return range(max(logprob_start, start), min(end, num_tokens - 1))
