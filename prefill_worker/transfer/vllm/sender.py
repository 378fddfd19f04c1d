"""One request's KV staged for a vLLM decode to pull: the ``KVSender`` of the vLLM backend.

The life of a sender (``transfer.base`` names the states)::

    no ticket for the room           BOOTSTRAPPING  (not a vLLM request: another protocol's)
    ticket, staging blocks allocated READY          (num_cached_tokens 0: vLLM says nothing)
    mirror_slots × n (READY on)                     (those chunks' forwards write the blocks)
    send_pages × n                   TRANSFERRING   (a repack of what no forward wrote)
    send_aux, then every repack done SUCCESS        (blocks held under a lease; ticket done)
    no staging blocks free           FAILED         (the reason says how many were wanted)

A chunk planned once the blocks are taken is mirrored: the scheduler asks ``mirror_slots``
and the forward writes the chunk's K/V into the blocks beside its pages, so its
``send_pages`` (after that forward) queues nothing. The positions of sent pages that no
forward mirrored (a prefix-cache hit, chunks computed before the claim) are repacked off the
engine thread (``desk``; at TP > 1 on every rank, each its own heads); ``poll`` completes
the ticket, and with it the HTTP answer that
lets a decode READ, only when all of them are done: a fully mirrored request answers right
after its last forward. Until then the sender owns its staging blocks and ``close`` frees
them, after waiting for a repack still writing into them (the engine closes a sender whose
chunk is in a forward only once that forward is collected); from then the hold table does.
The aux row is not sent: the first token reaches vLLM's proxy in the HTTP answer, and the
decode computes from the prompt it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, wait

from prefill_worker.request import TransferStats
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.vllm.desk import PullDesk
from prefill_worker.transfer.vllm.staging import block_slots


class TicketSender:
    """What a vLLM request's senders share (``VllmSender``, ``direct.DirectSender``): the room's
    ticket ends in its blocks held under the desk's lease (``_hold``), or in a failure."""

    def __init__(self, desk: PullDesk, room: int, num_prompt_tokens: int) -> None:
        self._desk, self._room, self._num_tokens = desk, room, num_prompt_tokens
        self._state = KVPoll.BOOTSTRAPPING
        self._reason: str | None = None

    def _hold(self, blocks: tuple[int, ...]) -> bool:
        """Hand ``blocks`` to the desk's hold table (SUCCESS); False (FAILED) when the HTTP
        request is gone, the desk then freeing them."""
        if self._desk.hold(self._room, blocks, self._num_tokens):
            self._state = KVPoll.SUCCESS
            return True
        self.fail("the HTTP request gave up before its KV was staged")
        return False

    def fail(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.FAILED, reason

    def failure_reason(self) -> str | None:
        return self._reason

    def why_no_handshake(self) -> str | None:
        return None


class VllmSender(TicketSender):
    """KVSender over the desk's staging blocks for one room."""

    def __init__(self, desk: PullDesk, room: int, num_prompt_tokens: int) -> None:
        super().__init__(desk, room, num_prompt_tokens)
        self._blocks: tuple[int, ...] | None = None  # owned until held or closed
        self._written = 0
        self._mirrored: list[range] = []  # prompt positions the forward writes into the blocks
        self._mirrored_bytes = 0  # of those, in pages sent
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

    def mirror_slots(self, start: int, end: int) -> Sequence[int]:
        """The staging rows of positions [start, end) once the blocks are this request's."""
        if self._blocks is None or self._state.is_terminal or self._desk.window is not None:
            return ()  # a windowed sliding pool has no mirror: its sends are repacked
        self._mirrored.append(range(start, end))
        return block_slots(self._blocks, self._desk.staging.layout.block_size, start, end)

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        assert self._blocks is not None, "send_pages before READY"
        if self._state.is_terminal:
            return
        self._state = KVPoll.TRANSFERRING
        ps, n, blocks = self._desk.page_size, self._num_tokens, self._blocks
        sent = range(first_page * ps, min((first_page + len(page_ids)) * ps, n))
        gaps = _not_in(sent, self._mirrored)
        for tokens in gaps:
            try:
                begun = self._desk.begin_stage(
                    page_ids, first_page, blocks, tokens, sliding_page_ids, n
                )
            except ValueError as exc:  # a windowed pool's window page missing: nothing queued
                self.fail(f"vllm staging: {exc}")
                return
            self._repacks.extend(begun)
        self._mirrored_bytes += self._desk.note_mirrored(len(sent) - sum(map(len, gaps)))

    def send_aux(self, aux_row: int) -> None:
        assert self._blocks is not None, "send_aux before READY"
        if self._state.is_terminal:  # failed staging a chunk: its blocks wait for close
            return
        self._repacks.extend(self._desk.stage_state(aux_row, self._blocks))  # slot = aux row
        self._state, self._is_aux_sent = KVPoll.TRANSFERRING, True
        self._try_hold()

    def _try_hold(self) -> None:
        """Once every repack is done: hold the blocks and complete the ticket."""
        if not all(f.done() for f in self._repacks):
            return
        errors = [e for e in (f.exception() for f in self._repacks) if e is not None]
        if errors:  # at TP > 1 also: the group failed before a step carried the followers'
            self.fail(f"a repack failed: {errors[0]}")
            return
        self._written = self._mirrored_bytes + sum(f.result() for f in self._repacks)
        blocks, self._blocks = self._blocks, None
        assert blocks is not None, "held twice"
        self._hold(blocks)

    def transfer_stats(self) -> TransferStats:
        return TransferStats(self._written)  # the decode READs: no writes of ours to count

    def close(self) -> None:
        for future in self._repacks:
            future.cancel()
        # One still copying writes into the blocks (at TP > 1 also a follower's stage that a
        # step already carries): free them after it.
        wait([f for f in self._repacks if not f.cancelled()])
        if self._blocks is not None:
            self._desk.staging.free(self._blocks)
            self._blocks = None

    def _claim(self) -> None:
        blocks = self._desk.try_allocate(self._num_tokens)
        if blocks is None:
            self.fail(self._desk.why_full(self._num_tokens))
        else:
            self._blocks, self._state = blocks, KVPoll.READY


def _not_in(tokens: range, covered: Sequence[range]) -> list[range]:
    """The runs of ``tokens`` that no range of ``covered`` contains, in order."""
    gaps, at = [], tokens.start
    for span in sorted(covered, key=lambda r: r.start):
        low, high = max(span.start, tokens.start), min(span.stop, tokens.stop)
        if low >= high:
            continue
        if low > at:
            gaps.append(range(at, low))
        at = max(at, high)
    if at < tokens.stop:
        gaps.append(range(at, tokens.stop))
    return gaps
