"""Start-up of an attention-DP rank whose experts are shared with the other DP ranks
(``parallel.ep_size`` = ``dp_size``): the model built over the DP world, every rank loaded,
and the forwards put in lockstep (``dp.lockstep``; docs/parallelism.md, "Expert parallelism
across attention-DP ranks"). Used by rank 0 (``dp_leader``) and every other rank
(``dp_rank``) alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from prefill_worker.dp.lockstep import Bell, Lockstep
from prefill_worker.model import KVCache, LoadProgress, ModelInfo, Runner
from prefill_worker.service.config import Config
from prefill_worker.service.startup import ModelBuilder, load_model, startup_step
from prefill_worker.tp.group import Membership


def shares_experts(config: Config) -> bool:
    """Whether the DP ranks' MoE layers share the experts (their forwards in lockstep)."""
    return config.parallel.ep_size > 1


def load_in_lockstep(
    config: Config,
    build_model: ModelBuilder,
    report: LoadProgress | None,
    membership: Membership,
    bell: Bell,
    bound: Callable[[Callable[[], Any]], Any],
    on_failure: Callable[[], None],
) -> tuple[Lockstep, KVCache, ModelInfo]:
    """This rank's model with its experts; once every rank loaded (a barrier on the world's
    default group, ``bound`` by the caller: rank 0 watches the rank processes), the
    ``Lockstep`` every forward goes through, its step thread started (from then on the
    ranks vote every ``parallel.heartbeat_interval_s``)."""
    dp = membership.tp
    runner, kv_cache, info = load_model(config, build_model, report, dp=dp)
    with startup_step("dp ranks loaded", (RuntimeError, TimeoutError)):
        if not isinstance(runner, Runner):  # a draft is refused at ep_size > 1 by build
            raise RuntimeError(f"an attention-DP rank with experts needs a Runner, not {runner}")
        bound(dist.barrier)  # the default group: the rendezvous timeout (a load is long)
    interval_s = config.parallel.heartbeat_interval_s
    lockstep = Lockstep(runner, dp.rank, membership.control, bell, interval_s, on_failure)
    lockstep.start()
    return lockstep, kv_cache, info


class LockstepWatch:
    """A DP rank's lockstep as its supervisor watches it (``supervisor.RankGroup``): a
    failed lockstep fails the rank (exit 70), and the worker with it."""

    def __init__(self, lockstep: Lockstep) -> None:
        self.lockstep = lockstep

    def problem(self) -> str | None:
        return self.lockstep.failure

    def is_busy(self) -> bool:
        return False
