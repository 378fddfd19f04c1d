"""Which attention-DP rank serves a request, and the rooms each rank was given.

The rule (docs/parallelism.md, "Which rank serves a request"): the rank the router named
(``dp_rank``; SGLang's ``data_parallel_rank`` / ``disagg_prefill_dp_rank``) when it named one,
else ``bootstrap_room % dp_size``. Not by load: a decode that was not told the rank finds it
with no query when the worker advertises ``follow_bootstrap_room`` (as SGLang 0.5.23's decode
does, ``_resolve_prefill_dp_rank``), and that holds only while the room alone decides. A
decode that asks the wrong rank anyway has its room failed at once with the rank to ask
(``rank_rule``). The rooms placed are kept (bounded, oldest forgotten first) so that
``/query_dp_ranks`` answers a decode that asks. No torch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from prefill_worker.transfer.base import TransferBackend
from prefill_worker.transfer.validate import Refusal, RejectReason

log = logging.getLogger(__name__)


class RankOutOfRange(ValueError):
    """A named ``dp_rank`` this worker does not have."""


def place(bootstrap_room: int, dp_size: int, named: int | None = None) -> int:
    """The rank that serves a request: ``named`` when given, else the room's rule."""
    if named is None:
        return bootstrap_room % dp_size
    if not 0 <= named < dp_size:
        raise RankOutOfRange(f"dp_rank {named} is not in [0, {dp_size})")
    return named


def rank_rule(dp_rank: int, dp_size: int) -> Callable[[int], Refusal | None]:
    """For rank ``dp_rank``'s transfer hub: why a decode's want for a room is another rank's
    (the room's rule names another; its request never comes here), else None. The reason
    names the rank to ask, and no room (rooms are capabilities; reasons reach logs)."""

    def elsewhere(bootstrap_room: int) -> Refusal | None:
        owner = bootstrap_room % dp_size
        if owner == dp_rank:
            return None
        why = (
            f"this room is served by attention-DP rank {owner} of {dp_size}, not rank "
            f"{dp_rank}: ask that rank (SGLang: prefill_dp_rank {owner}, or /query_dp_ranks)"
        )
        return Refusal(RejectReason.WRONG_DP_RANK, why)

    return elsewhere


def serve_own_rooms(backend: TransferBackend, dp_rank: int, dp_size: int) -> None:
    """Have the rank's hub refuse other ranks' rooms (native and SGLang's protocol alike)."""
    from prefill_worker.transfer.push.hub import HubBackend

    if isinstance(backend, HubBackend):
        backend.serve_rooms_of(rank_rule(dp_rank, dp_size))
    else:  # a wrapped backend (a hybrid model's state guard): wants for others wait instead
        log.warning("dp rank %d: its backend cannot refuse other ranks' rooms", dp_rank)


class RoomRanks:
    """The rank each recent room went to: at most ``capacity`` rooms, oldest forgotten."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._ranks: OrderedDict[int, int] = OrderedDict()
        self._capacity = capacity

    def record(self, bootstrap_room: int, dp_rank: int) -> None:
        self._ranks[bootstrap_room] = dp_rank
        self._ranks.move_to_end(bootstrap_room)
        while len(self._ranks) > self._capacity:
            self._ranks.popitem(last=False)

    def rank_of(self, bootstrap_room: int) -> int | None:
        return self._ranks.get(bootstrap_room)

    def query(self, rooms: Iterable[int]) -> dict[str, int]:
        """SGLang's ``/query_dp_ranks`` answer: each known room (as a string) to its rank."""
        return {str(room): rank for room in rooms if (rank := self._ranks.get(room)) is not None}

    def __len__(self) -> int:
        return len(self._ranks)
