"""One request's KV staged for a vLLM decode to pull: the ``KVSender`` of the vLLM backend.

The life of a sender (``transfer.base`` names the states)::

    no ticket for the room           BOOTSTRAPPING  (not a vLLM request: another protocol's)
    ticket, staging blocks allocated READY          (num_cached_tokens 0: vLLM says nothing)
    send_pages × n                   TRANSFERRING   (each call begins a repack into the blocks)
    send_aux, then every repack done SUCCESS        (blocks held under a lease; ticket done)
    no staging blocks free           FAILED         (the reason says how many were wanted)

The repacks run off the engine thread (``desk``); ``poll`` completes the ticket, and with it
the HTTP answer that lets a decode READ, only when all of them are done. Until then the
sender owns its staging blocks and ``close`` frees them, after waiting for a repack still
writing into them; from then the hold table does. The aux row is not sent: the first token
reaches vLLM's proxy in the HTTP answer, and the decode computes from the prompt it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, wait

from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.vllm.desk import PullDesk


class VllmSender:
    """KVSender over the desk's staging blocks for one room."""

    def __init__(self, desk: PullDesk, room: int, num_prompt_tokens: int) -> None:
        self._desk, self._room, self._num_tokens = desk, room, num_prompt_tokens
        self._state = KVPoll.BOOTSTRAPPING
        self._blocks: tuple[int, ...] | None = None  # owned until held or closed
        self._reason: str | None = None
        self._written = 0
        self._repacks: list[Future[int]] = []
        self._is_aux_sent = False

    def poll(self) -> KVPoll:
        if self._state is KVPoll.BOOTSTRAPPING and self._desk.tickets.is_open(self._room):
            self._claim()
        elif self._state is KVPoll.TRANSFERRING and self._is_aux_sent:
            self._try_hold()
        return self._state

    def num_cached_tokens(self) -> int:
        return 0

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        assert self._blocks is not None, "send_pages before READY"
        self._state = KVPoll.TRANSFERRING
        blocks, num_tokens = self._blocks, self._num_tokens
        self._repacks.append(self._desk.begin_stage(page_ids, first_page, blocks, num_tokens))

    def send_aux(self, aux_row: int) -> None:
        assert self._blocks is not None, "send_aux before READY"
        self._state, self._is_aux_sent = KVPoll.TRANSFERRING, True
        self._try_hold()

    def _try_hold(self) -> None:
        """Once every repack is done: hold the blocks and complete the ticket."""
        if not all(f.done() for f in self._repacks):
            return
        self._written = sum(f.result() for f in self._repacks)
        blocks, self._blocks = self._blocks, None
        assert blocks is not None, "held twice"
        if self._desk.hold(self._room, blocks, self._num_tokens):
            self._state = KVPoll.SUCCESS
        else:
            self.fail("the HTTP request gave up before its KV was staged")

    def fail(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.FAILED, reason

    def failure_reason(self) -> str | None:
        return self._reason

    def why_no_handshake(self) -> str | None:
        return None

    def written_bytes(self) -> int:
        return self._written

    def close(self) -> None:
        for future in self._repacks:
            future.cancel()
        wait(self._repacks)  # one still copying writes into the blocks: free them after it
        if self._blocks is not None:
            self._desk.staging.free(self._blocks)
            self._blocks = None

    def _claim(self) -> None:
        blocks = self._desk.try_allocate(self._num_tokens)
        if blocks is None:
            self.fail(self._desk.why_full(self._num_tokens))
        else:
            self._blocks, self._state = blocks, KVPoll.READY
