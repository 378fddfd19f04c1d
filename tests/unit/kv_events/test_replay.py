"""The replay buffer and the answer to one request (the frames vLLM 0.31.0's publisher sends)."""

from __future__ import annotations

import pytest

from prefill_worker.kv_events.replay import ReplayBuffer, answer
from prefill_worker.kv_events.wire import END_OF_REPLAY_SEQ, seq_frame

END = [b"id", b"", b"", END_OF_REPLAY_SEQ, b""]


def filled(num_batches: int, num_published: int) -> ReplayBuffer:
    buffer = ReplayBuffer(num_batches)
    for seq in range(num_published):
        buffer.append(seq, f"batch-{seq}".encode())
    return buffer


def request(start_seq: int) -> list[bytes]:
    return [b"id", b"", seq_frame(start_seq)]


def test_answers_every_held_batch_from_the_start_seq_then_the_end_marker() -> None:
    reply = answer(request(3), filled(10, 5), b"kv")
    assert reply.outcome == "served"
    assert reply.messages == [
        [b"id", b"", b"kv", seq_frame(3), b"batch-3"],
        [b"id", b"", b"kv", seq_frame(4), b"batch-4"],
        END,
    ]


def test_a_start_past_the_newest_gets_only_the_end_marker() -> None:
    reply = answer(request(5), filled(10, 5), b"")
    assert (reply.messages, reply.outcome) == ([END], "served")
    assert answer(request(0), ReplayBuffer(4), b"").messages == [END]


def test_batches_that_left_the_buffer_make_the_answer_truncated() -> None:
    buffer = filled(3, 8)  # holds 5, 6, 7
    reply = answer(request(2), buffer, b"")
    assert reply.outcome == "truncated"
    assert [m[3] for m in reply.messages[:-1]] == [seq_frame(5), seq_frame(6), seq_frame(7)]
    assert answer(request(5), buffer, b"").outcome == "served"
    assert len(buffer) == 3


@pytest.mark.parametrize(
    "frames",
    [
        [b"id", seq_frame(0)],  # no delimiter
        [b"id", b"x", seq_frame(0)],  # a delimiter that is not empty
        [b"id", b"", b"\x00\x01"],  # not 8 bytes
        [b"id", b"", seq_frame(0), b"more"],
    ],
)
def test_a_malformed_request_is_counted_and_not_answered(frames: list[bytes]) -> None:
    reply = answer(frames, filled(4, 2), b"")
    assert (reply.messages, reply.outcome) == ([], "bad_request")


def test_the_buffer_holds_at_least_one_batch() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ReplayBuffer(0)
