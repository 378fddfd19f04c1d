"""An attention-DP rank's process: join the DP world, then serve as a whole TP-1 worker whose
requests come from the leader over the rank link (docs/parallelism.md, "Attention data
parallelism").

Started by the DP leader (``dp_leader.py``) as ``python -m prefill_worker.service.dp_rank
--rank R --world-size N --port P --parent-pid PID --link ENDPOINT`` with the group's secret
and the resolved configuration on stdin (``tp.followers``). It dies with its leader
(``PR_SET_PDEATHSIG``), joins the DP world over gloo (NCCL on CUDA) and proves it holds the
secret (``tp.group.join``), then runs its own model, pools, engine and transfer endpoints
(its own NIXL agent, native bootstrap socket, SGLang control socket) on ports the kernel picks;
its front is the link (``dp.front.RankFront``). With the experts shared over the DP ranks
(``parallel.ep_size`` = ``dp_size``) its model holds its experts and every forward goes
through the lockstep (``dp.lockstep``), whose failure fails the rank (exit 70). It ignores
SIGTERM and SIGINT: the leader drains and then sends ``stop``. Exit codes as the daemon's: 0
after a stop, 78 for a configuration problem, 1 at start-up, 70 for a fatal engine error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import cast

from prefill_worker.batch import ModelRunner
from prefill_worker.dp.front import RankFront
from prefill_worker.dp.lockstep import Bell, Lockstep, bell_path
from prefill_worker.dp.place import serve_own_rooms
from prefill_worker.ingress.zmq_front import Ingress
from prefill_worker.model import KVCache, ModelInfo
from prefill_worker.scheduler import Engine
from prefill_worker.service.config import EX_CONFIG, Config
from prefill_worker.service.daemon import Daemon
from prefill_worker.service.dp_lockstep import LockstepWatch, load_in_lockstep, shares_experts
from prefill_worker.service.fdlimit import raise_fd_limit
from prefill_worker.service.group_startup import tp_timeouts
from prefill_worker.service.logs import configure_logging
from prefill_worker.service.startup import LoadReport
from prefill_worker.service.supervisor import Serving, Supervisor
from prefill_worker.service.teardown import prepare_exit
from prefill_worker.tp.followers import die_with_parent, read_stdin
from prefill_worker.tp.group import Membership, Placement, join, leave, rank_device

log = logging.getLogger("prefill_worker.service.dp_rank")


def _any_port(bind: str) -> str:
    return f"{bind.rpartition(':')[0]}:0"


def rank_config(config: Config, dp_rank: int, device: str) -> Config:
    """Rank ``dp_rank``'s own configuration: its endpoints on the leader's hosts at ports the
    kernel picks, no router-facing front of its own, no ready file, a drain that ends once
    idle (the leader drained the routers already)."""
    t = config.transfer
    transfer = t.model_copy(
        update={
            "bootstrap_bind": _any_port(t.bootstrap_bind),
            "sglang_bootstrap_bind": _any_port(t.sglang_bootstrap_bind),
            "sglang_rank_ip": t.sglang_rank_ip or t.sglang_bootstrap_bind.rpartition(":")[0],
            "sglang_rank_port": 0,
            "sglang_rejoin_s": 0.0,  # decodes reach the leader's routes, which hold them off
            "agent_name": f"{t.agent_name}-dp{dp_rank}" if t.agent_name else None,
        }
    )
    return config.model_copy(
        update={
            "model": config.model.model_copy(update={"device": device}),
            "transfer": transfer,
            "metrics": config.metrics.model_copy(update={"bind": _any_port(config.metrics.bind)}),
            "http_api": config.http_api.model_copy(update={"enabled": False}),
            "daemon": config.daemon.model_copy(update={"ready_file": None, "drain_min_s": 0.0}),
            "parallel": config.parallel.model_copy(update={"dp_size": 1}),
        }
    )


class RankDaemon(Daemon):
    """A whole TP-1 worker whose front is the link to its DP leader."""

    def __init__(
        self,
        config: Config,
        env: Mapping[str, str],
        link: str,
        dp_rank: int,
        dp_size: int,
        membership: Membership | None = None,
    ) -> None:
        super().__init__(config, env)
        self._link, self._dp_rank, self.config_dp_size = link, dp_rank, dp_size
        self._front: RankFront | None = None
        self._membership = membership  # the DP world (the experts' exchanges, the votes)
        self._lockstep: Lockstep | None = None

    def _load(self, placement: Placement | None) -> tuple[ModelRunner, KVCache, ModelInfo]:
        """Experts shared over the DP ranks: every forward in lockstep with rank 0's."""
        if not shares_experts(self.config):
            return super()._load(placement)
        assert self._membership is not None
        link_dir = self._link.removeprefix("ipc://").rpartition("/")[0]
        bell = Bell(bell_path(link_dir), listen=False)
        report = LoadReport(self.notifier.status)
        lockstep, kv_cache, info = load_in_lockstep(
            self.config, self._build_model, report, self._membership, bell,
            lambda work: work(), self._wake.set,
        )  # fmt: skip
        self._lockstep = lockstep
        self._closers.append(("dp lockstep", self._stop_lockstep))
        return lockstep, kv_cache, info

    def _stop_lockstep(self) -> None:
        """Rank 0 ended every step thread before its stop; after a failure, no wait."""
        assert self._lockstep is not None
        self._lockstep.stop(0.0 if self._lockstep.failure else 1.0)

    def _supervisor(self) -> Supervisor:
        if self._lockstep is None:
            return super()._supervisor()
        assert self._engine is not None and self._engine_thread is not None
        watch = LockstepWatch(self._lockstep)
        serving = Serving(
            self._engine, self._engine_thread, self.inbox, self.ingress, self._http_api, watch
        )
        cfg, requests = self.config.daemon, self.stop_requests
        return Supervisor(cfg, serving, requests, self.health, self.metrics, self.notifier)

    def _start_front(self, engine: Engine, limits: tuple[int, int, int]) -> Ingress:
        load = lambda: engine.load  # noqa: E731
        front = RankFront(self._link, self._dp_rank, self.inbox, load, self.request_drain)
        self._front = front
        return cast(Ingress, front)  # what the daemon asks of an ingress, duck-typed

    def _more_endpoints(self) -> dict[str, object]:
        size = self.config_dp_size
        serve_own_rooms(self._transfer_backend, self._dp_rank, size)
        return {}

    def _announce(self, http_port: int) -> None:
        super()._announce(http_port)
        assert self._front is not None
        self._front.announce({**self.health.endpoints, "dp_rank": self._dp_rank})


def run_rank(config: Config, placement: Placement, link: str, secret: bytes) -> int:
    """Serve as DP rank ``placement.rank`` until the leader's stop (main thread)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the leader drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = rank_device(config.model.device, placement)
    except ValueError as exc:
        log.error("dp rank %d: %s", placement.rank, exc)
        return EX_CONFIG
    try:
        membership = join(placement, device, tp_timeouts(config), None, secret)
    except Exception:
        log.exception("dp rank %d: joining the group failed", placement.rank)
        return 1
    own = rank_config(config, placement.rank, device)
    daemon = RankDaemon(own, {}, link, placement.rank, placement.size, membership)
    codes: list[int] = []
    # Not on the main thread: the daemon leaves the signals alone (ignored above).
    thread = threading.Thread(target=lambda: codes.append(daemon.run()), name="dp-rank")
    thread.start()
    thread.join()
    leave()
    return codes[0] if codes else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefill_worker.service.dp_rank")
    for flag in ("--rank", "--world-size", "--port", "--parent-pid"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--link", required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    secret, config_json = read_stdin(sys.stdin.buffer.read())
    config = Config.model_validate_json(config_json)
    configure_logging(config.daemon.log_level, config.daemon.log_format)
    raise_fd_limit()
    placement = Placement(args.rank, args.world_size, args.rank, args.port, False)
    code = run_rank(config, placement, args.link, secret)
    prepare_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())
