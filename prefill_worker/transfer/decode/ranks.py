"""Which of an attention-DP worker's ranks a decode asks for a room (docs/protocol.md,
"Attention-DP workers").

A worker of ``parallel.dp_size`` N publishes (``/readyz``, its ready file) ``dp_size`` and
``dp_ranks``, each rank's endpoints; rank 0's are the worker's own. A room is served by rank
``bootstrap_room % N`` (the worker places every request so), and that rank's ``bootstrap`` is
where a native decode's ``KVReceiver`` registers for it. A want sent to another rank fails at
once with status reason ``wrong_dp_rank``, naming the rank to ask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def dp_rank_of(endpoints: Mapping[str, Any], bootstrap_room: int) -> int:
    """The rank of the worker whose published ``endpoints`` serves ``bootstrap_room``."""
    return bootstrap_room % int(endpoints.get("dp_size", 1))


def rank_bootstrap(endpoints: Mapping[str, Any], bootstrap_room: int) -> str:
    """The native bootstrap endpoint of the rank serving ``bootstrap_room``."""
    dp_rank = dp_rank_of(endpoints, bootstrap_room)
    if dp_rank == 0:
        return str(endpoints["bootstrap"])
    return str(endpoints["dp_ranks"][dp_rank - 1]["bootstrap"])
