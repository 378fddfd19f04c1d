"""The replay side of the KV-event publisher: the last batches sent, resent on request.

A subscriber that sees a gap in the sequence numbers (it joined late, or its queue overflowed)
asks the replay socket (a ZMQ ROUTER) for everything from a sequence number on, as vLLM 0.31.0's
``ZmqEventPublisher`` answers it::

    request   (DEALER/REQ → ROUTER)  [b"", start_seq]                 start_seq: 8 bytes, big-endian
    replies, oldest first, one per held batch with seq >= start_seq:
                                     [b"", topic, seq, payload]        the PUB message's frames
    then                             [b"", b"", END_OF_REPLAY_SEQ, b""]

(The ROUTER also sees and sends the requester's identity frame first; the DEALER never sees it.)
Only the last ``num_batches`` batches are held: a request older than that gets what is left,
and is counted as ``truncated``. A request of any other shape is counted and left unanswered.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Literal

from prefill_worker.kv_events.wire import END_OF_REPLAY_SEQ, seq_frame

ReplayOutcome = Literal["served", "truncated", "bad_request"]


@dataclass(frozen=True, slots=True)
class ReplayAnswer:
    """The messages (identity frame first) that answer one request, and how it went."""

    messages: list[list[bytes]]
    outcome: ReplayOutcome


class ReplayBuffer:
    """The last ``num_batches`` (seq, payload) pairs, in sequence order (publisher thread)."""

    def __init__(self, num_batches: int) -> None:
        if num_batches < 1:
            raise ValueError(f"the replay buffer must hold at least 1 batch, not {num_batches}")
        self._batches: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=num_batches)

    def append(self, seq: int, payload: bytes) -> None:
        assert not self._batches or seq == self._batches[-1][0] + 1, "sequence numbers are dense"
        self._batches.append((seq, payload))

    def since(self, start_seq: int) -> tuple[list[tuple[int, bytes]], bool]:
        """The held batches from ``start_seq`` on, and whether older ones it asked for are gone."""
        held = [(seq, payload) for seq, payload in self._batches if seq >= start_seq]
        is_truncated = bool(self._batches) and start_seq < self._batches[0][0]
        return held, is_truncated

    def __len__(self) -> int:
        return len(self._batches)


def answer(request: list[bytes], buffer: ReplayBuffer, topic: bytes) -> ReplayAnswer:
    """What to send back for one request read off the ROUTER socket."""
    if len(request) != 3 or request[1] != b"" or len(request[2]) != 8:
        return ReplayAnswer([], "bad_request")
    identity = request[0]
    batches, is_truncated = buffer.since(int.from_bytes(request[2], "big"))
    messages = [[identity, b"", topic, seq_frame(seq), payload] for seq, payload in batches]
    messages.append([identity, b"", b"", END_OF_REPLAY_SEQ, b""])
    return ReplayAnswer(messages, "truncated" if is_truncated else "served")
