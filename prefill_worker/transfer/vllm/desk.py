"""The engine-thread side of vLLM pulls: staging blocks, their holds, and the params each
request's answer carries. NIXL-free (the backend feeds it notifications and the clock), so
every path that frees a block is tested without a decode.

Most of a request's tokens reach its blocks from the forward itself (the runner's mirror of
the pool, ``staging.block_slots``); the tokens no forward wrote there (prefix-cache hits,
chunks computed before the claim) are repacked from the pool on ``repacker`` (one thread in
production), not on the engine thread: a repack overlaps the next chunk's forward as a push
does, and numpy's copies release the GIL. A sender completes its ticket (which is what sends
the HTTP answer, hence the decode's READ) only once every repack it began is done, so a READ
never finds a block unfilled. ``counts`` says how many tokens went each way.

Every staging block is in exactly one place: free in the pool, owned by a sender (until its
``send_aux`` or ``close``), held (until its readers are done or its lease ends), or waiting
out the read grace after expiry (``holds``). ``close`` returns all of them.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from prefill_worker.lograte import RateLimitedLog
from prefill_worker.transfer.vllm.groups import VllmGroups
from prefill_worker.transfer.vllm.holds import BadNotification, HoldTable
from prefill_worker.transfer.vllm.profiles import PULL, PUSH, channel_key
from prefill_worker.transfer.vllm.push import Early, Expected, PushBook
from prefill_worker.transfer.vllm.shared import GroupStaging, Stage
from prefill_worker.transfer.vllm.staging import BlockStore, PoolViews, StagingPool, repack
from prefill_worker.transfer.vllm.state_staging import StateStaging
from prefill_worker.transfer.vllm.tickets import Tickets
from prefill_worker.transfer.vllm.window_staging import StagedWindow, check_window, repack_window

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PullIdentity:
    """What a decode needs to reach this worker, as its ``kv_transfer_params`` say."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    registration_generation: int


def pull_params(
    identity: PullIdentity,
    hold_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    mode: str = PULL,
    groups: VllmGroups | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill answer, as vLLM 0.33's and 0.34's own prefills
    send them (one block list per KV-cache group: one unless ``groups`` says, a sliding group's
    its window's; tensor, decode-context and pipeline parallel sizes 1; no expiry
    time, which vLLM reads only for decode-side blocks); ``mode`` the decode's (a push decode
    registers with the side channel named here, its push channel)."""
    block_lists = [list(block_ids)] if groups is None else groups.block_ids(block_ids)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_lists,
        "remote_engine_id": identity.engine_id,
        "remote_request_id": hold_id,
        "remote_host": identity.side_channel_host,
        "remote_port": identity.side_channel_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": identity.registration_generation,
        "transfer_mode": mode,
    }


BAD_NOTIFICATION_LOG_S = 10.0  # malformed notifications: one log line per this (all counted)


@dataclass(slots=True)
class StageCounts:
    """Tokens staged so far, by who wrote them (engine thread; scrapes read the ints)."""

    mirrored_tokens: int = 0  # by the forward, into the blocks
    repacked_tokens: int = 0  # copied from the pool on the repack thread
    repacks: int = 0  # repacks begun (one per run of tokens no forward wrote)
    pool_tokens: int = 0  # served from the pool itself (a vllm_blocks pool: ``direct``)


class PullDesk:
    """Stages, holds and frees; ``identities`` (one per vLLM version served, each naming its
    own side channel) are set once the side channels are bound."""

    def __init__(
        self,
        staging: BlockStore,
        pool: PoolViews,
        holds: HoldTable,
        tickets: Tickets,
        clock: Callable[[], float],
        repacker: Executor,
        group: GroupStaging | None = None,
    ) -> None:
        """``group``: at TP > 1, the heads ``pool`` holds (this worker's repacks copy those)
        and the followers' stages (they copy theirs)."""
        self.staging, self.holds, self.tickets = staging, holds, tickets
        self._group = group
        self._pool, self._clock, self._repacker = pool, clock, repacker
        self._repacks: list[Future[int]] = []  # begun, pruned by has_repacks
        self.identities: Mapping[str, PullIdentity] = {}  # by profiles.channel_key
        self.pushes = PushBook(holds.lease_s, max_early=staging.layout.num_blocks)
        self.matched: list[tuple[Expected, Early]] = []  # push holds whose decode came first
        self.page_size = pool.page_size
        self.groups: VllmGroups | None = None  # a hybrid model's KV-cache groups
        self.state_staging: StateStaging | None = None  # its linear layers' state pages
        self.window: StagedWindow | None = None  # a windowed sliding pool (window_staging)
        self.counts = StageCounts()
        self.bad_log = RateLimitedLog(log, BAD_NOTIFICATION_LOG_S)

    def stage_state(self, slot: int, blocks: Sequence[int]) -> list[Future[int]]:
        """A hybrid model's request: its state slot into its last block's state pages (the
        block its mamba groups name, ``groups``), queued behind its repacks (the slot and the
        blocks stay the request's until its sender is closed); nothing for other models."""
        if self.state_staging is None or not blocks:
            return []
        future = self._repacker.submit(self.state_staging.write, slot, blocks[-1])
        self._repacks.append(future)
        return [future]

    def try_allocate(self, num_tokens: int) -> tuple[int, ...] | None:
        staging = self.staging
        assert isinstance(staging, StagingPool), "a request's blocks in the pool are its pages"
        return staging.try_allocate(staging.layout.num_blocks_for(num_tokens))

    def why_full(self, num_tokens: int) -> str:
        need = self.staging.layout.num_blocks_for(num_tokens)
        return (
            f"vLLM staging full: {num_tokens} tokens need {need} blocks, "
            f"{self.staging.num_free} of {self.staging.layout.num_blocks} free "
            f"({len(self.holds)} held for decodes)"
        )

    def begin_stage(
        self,
        page_ids: Sequence[int],
        first_page: int,
        blocks: Sequence[int],
        tokens: range,
        sliding_page_ids: Sequence[int] = (),
        num_tokens: int = 0,
    ) -> list[Future[int]]:
        """The repack of prompt positions ``tokens`` (within the prompt pages ``page_ids``
        hold, from ``first_page``), queued behind the ones before it; its bytes when done. At
        TP > 1 also the followers' (``shared.Stage``), a second future. A windowed sliding
        pool's (``window``) copies its sliding layers' window from ``sliding_page_ids`` (of
        the same prompt pages) of the ``num_tokens`` prompt: ``ValueError``, nothing queued,
        when one of them is not given or not held."""
        group, staging = self._group, self.staging
        assert isinstance(staging, StagingPool), "the pool's own pages need no repack"
        if self.window is not None:
            assert group is None, "a windowed sliding pool is staged at TP 1"
            window, pages, sliding = self.window, tuple(page_ids), tuple(sliding_page_ids)
            check_window(window, sliding, len(pages), first_page, tokens, num_tokens)
            future = self._repacker.submit(
                repack_window,
                self._pool,
                staging,
                window,
                pages,
                sliding,
                first_page,
                blocks,
                tokens,
                num_tokens,
            )
            return self._begun([future], tokens)
        heads = None if group is None else group.heads
        args = (self._pool, staging, tuple(page_ids), first_page, blocks, tokens, heads)
        futures = [self._repacker.submit(repack, *args)]
        if group is not None and group.stages is not None:
            stage = Stage(list(page_ids), first_page, list(blocks), tokens.start, tokens.stop)
            futures.append(group.stages.put(stage))
        return self._begun(futures, tokens)

    def _begun(self, futures: list[Future[int]], tokens: range) -> list[Future[int]]:
        self._repacks.extend(futures)
        self.counts.repacks += 1
        self.counts.repacked_tokens += len(tokens)
        return futures

    def sync(self) -> None:
        """At TP > 1, followers' stages waiting for a step: send one now if none runs."""
        group = self._group
        if group is not None and group.stages is not None and group.stages.has_queued:
            group.sync()

    def note_mirrored(self, num_tokens: int) -> int:
        """``num_tokens`` the forward wrote into a request's blocks were sent; their bytes."""
        self.counts.mirrored_tokens += num_tokens
        return num_tokens * self.staging.layout.token_bytes

    def has_repacks(self) -> bool:
        """Whether a repack is queued or running (the engine should poll soon)."""
        self._repacks = [f for f in self._repacks if not f.done()]
        return bool(self._repacks)

    def hold(self, room: int, blocks: tuple[int, ...], num_tokens: int) -> bool:
        """Hold the staged ``blocks`` and complete the room's ticket with the params of the
        vLLM version it asked for; False (blocks freed) when the ticket is gone: nobody will
        learn where they are."""
        ask = self.tickets.ask_of(room)
        hold_id = f"pw-{secrets.token_hex(16)}"  # unguessable: holds.py says why
        identity = None if ask is None else self.identities.get(channel_key(ask.version, ask.mode))
        params = None
        if ask is not None and identity is not None:
            params = pull_params(identity, hold_id, blocks, num_tokens, ask.mode, self.groups)
        if ask is None or params is None or not self.tickets.complete(room, params):
            self.staging.free(blocks)
            return False
        now = self._clock()
        self.holds.hold(hold_id, blocks, now)
        if ask.mode == PUSH and ask.push_key is not None:
            pair = self.pushes.expect(ask.push_key, hold_id, ask.version, now)
            if pair is not None:  # its decode registered already: the backend writes it
                self.matched.append(pair)
        return True

    def notify(self, agent: str, message: bytes) -> None:
        """One NIXL notification from the decode agent ``agent``; a malformed one is counted,
        and logged at most once per ``BAD_NOTIFICATION_LOG_S`` (any agent may send them)."""
        now = self._clock()
        try:
            text = message.decode(errors="replace")
            self.staging.free(self.holds.notify(text, now, agent))
        except BadNotification as exc:
            self.bad_log.warning(now, "vllm: notification ignored: %s", exc)

    def expire(self) -> None:
        self.staging.free(self.holds.expire(self._clock()))
        if self.pushes.expected:
            self.pushes.forget_missing(self.holds.__contains__)

    def close(self) -> None:
        self.staging.free(self.holds.release_all())
