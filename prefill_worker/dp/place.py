"""Which attention-DP rank serves a request, and the rooms each rank was given.

The rule (docs/parallelism.md, "Which rank serves a request"): the rank the router named
(``dp_rank``; SGLang's ``data_parallel_rank`` / ``disagg_prefill_dp_rank``) when it named one,
else ``bootstrap_room % dp_size``. Not by load: a decode that was not told the rank finds it
with no query when the worker advertises ``follow_bootstrap_room`` (as SGLang 0.5.23's decode
does, ``_resolve_prefill_dp_rank``), and that holds only while the room alone decides. The
rooms placed are kept (bounded, oldest forgotten first) so that ``/query_dp_ranks`` answers a
decode that asks, and an explicit rank that differs from the room's rule can be told apart.
No torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class RankOutOfRange(ValueError):
    """A named ``dp_rank`` this worker does not have."""


def place(bootstrap_room: int, dp_size: int, named: int | None = None) -> int:
    """The rank that serves a request: ``named`` when given, else the room's rule."""
    if named is None:
        return bootstrap_room % dp_size
    if not 0 <= named < dp_size:
        raise RankOutOfRange(f"dp_rank {named} is not in [0, {dp_size})")
    return named


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
