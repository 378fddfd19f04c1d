"""The attention-DP leader: rank 0's worker, plus ranks 1..N-1 started, joined and watched,
and the one ingress placing each request on a rank (docs/parallelism.md, "Attention data
parallelism").

Rank 0 is the process ``serve`` started. It is a whole worker (its own scheduler, pools and
transfer endpoints) and the only router-facing one: the ZMQ ingress, the HTTP front,
``/metrics``, ``/readyz``. Its inbox (``DpInbox``) places each request (``dp.place``): its
own go to its engine, the others' over the rank link (``dp.relay``), whose outcomes come back
to the front that asked. The ranks are processes in one torch.distributed world (gloo; NCCL on
CUDA) with the group's secret, as a tensor-parallel group's followers are. With the experts
shared over the ranks (``parallel.ep_size`` = ``dp_size``) the world carries the MoE layers'
all-to-all, every rank's forwards in lockstep (``dp.lockstep``: rank 0 calls each step, a rank
with a plan rings its bell); otherwise it is idle. A rank that exits, or a lockstep that fails,
fails the worker (exit 70, every request in flight answered); SIGTERM drains every rank.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from prefill_worker.batch import ModelRunner
from prefill_worker.dp.lockstep import Bell, Lockstep, bell_path
from prefill_worker.dp.place import RoomRanks, place, serve_own_rooms
from prefill_worker.dp.relay import Relay
from prefill_worker.ingress.zmq_front import Ingress
from prefill_worker.load import LoadSnapshot
from prefill_worker.model import CheckpointError, KVCache, ModelInfo
from prefill_worker.model.hf_config import read_spec
from prefill_worker.model.moe.placement import check_expert_parallel
from prefill_worker.request import AbortRequest, FinishReason, PrefillRequest
from prefill_worker.scheduler import Engine
from prefill_worker.service.config import Config
from prefill_worker.service.daemon import Daemon
from prefill_worker.service.dp_loads import DpLoadCollector, combined
from prefill_worker.service.dp_lockstep import load_in_lockstep, shares_experts
from prefill_worker.service.group_startup import tp_timeouts
from prefill_worker.service.startup import LoadReport, start_ingress, startup_step
from prefill_worker.service.supervisor import Serving, Supervisor
from prefill_worker.service.tracing import RequestTracer, TracedInbox
from prefill_worker.tp.followers import Followers
from prefill_worker.tp.group import Membership, Placement, join, leave, open_store, rank_device

log = logging.getLogger("prefill_worker.service.daemon")

DP_RANK_COMMAND = (sys.executable, "-m", "prefill_worker.service.dp_rank")
_GRACE_S = 10.0  # the ranks' time to drain and leave after the stop, then SIGKILL


class DpInbox(TracedInbox):
    """Rank 0's inbox: a request placed on another rank goes over the link instead."""

    def __init__(self, tracer: RequestTracer, rooms: RoomRanks) -> None:
        super().__init__(tracer)
        self.rooms = rooms
        self.relay: Relay | None = None  # set before any front starts

    def _put(self, item: Any) -> None:  # queue.Queue's hook, called holding its mutex
        relay = self.relay
        if relay is not None and isinstance(item, PrefillRequest):
            dp_rank = place(item.bootstrap_room, relay.dp_size)
            self.rooms.record(item.bootstrap_room, dp_rank)
            if dp_rank != 0:
                relay.submit(dp_rank, item)
                return
        if relay is not None and isinstance(item, AbortRequest) and relay.cancel(item):
            return
        super()._put(item)


class DpRanks:
    """Ranks 1..N-1 as the supervisor watches them: a dead one is the worker's failure, and
    so is a failed lockstep (experts shared over the ranks, ``dp.lockstep``)."""

    def __init__(
        self, relay: Relay, followers: Followers, link_dir: str, stop_s: float = _GRACE_S
    ) -> None:
        self.relay, self.followers, self._link_dir = relay, followers, link_dir
        self.lockstep: Lockstep | None = None  # set once the model loaded, if the ranks share
        self._stop_s = stop_s  # the longest the lockstep's last step may take

    def problem(self) -> str | None:
        dead = self.followers.first_dead()
        if dead is not None:
            return f"attention-DP {dead}"
        return None if self.lockstep is None else self.lockstep.failure

    def stuck(self) -> str | None:
        """For ``/livez``: a rank gone, or one the kernel holds stopped (its requests would
        wait out their deadlines)."""
        problem = self.problem()
        if problem is not None:
            return problem
        stopped = self.followers.first_stopped()
        return None if stopped is None else f"an attention-DP {stopped}"

    def is_busy(self) -> bool:
        return self.relay.num_inflight > 0

    def close(self) -> None:
        is_whole = self.problem() is None
        if not is_whole:
            self.relay.fail_inflight(FinishReason.ENGINE_ERROR, "an attention-DP rank failed")
        else:
            self.relay.fail_inflight(FinishReason.DRAINING, "the worker stopped")
        grace_s = _GRACE_S
        if self.lockstep is not None:  # every rank's step thread ends before its stop
            # failed: no last vote (a rank would not answer), and no rank can leave in order
            self.lockstep.stop(self._stop_s if is_whole else 0.0, vote=is_whole)
            grace_s = grace_s if is_whole else 0.0
        self.relay.stop_ranks()
        self.followers.close(grace_s)
        self.relay.close()
        leave()
        shutil.rmtree(self._link_dir, ignore_errors=True)


class DpLeader(Daemon):
    def __init__(self, config: Config, env: Mapping[str, str], *args: Any) -> None:
        super().__init__(config, env, *args)
        self.rooms = RoomRanks()
        self.inbox = self._dp_inbox = DpInbox(self.tracer, self.rooms)
        self._ranks: DpRanks | None = None
        self._membership: Membership | None = None
        self._bell: Bell | None = None

    def _start(self, placement: Placement | None) -> None:
        self._start_ranks()  # they load while rank 0 does
        super()._start(placement)

    def _start_ranks(self) -> None:
        cfg, size = self.config, self.config.parallel.dp_size
        if shares_experts(cfg):
            with startup_step("dp experts", (ValueError, CheckpointError)):
                # refused before any rank starts (each rank's build checks it again)
                spec, par = read_spec(cfg.model.path), cfg.parallel
                check_expert_parallel(spec, 1, par.ep_size, par.expert_placement, size)
        with startup_step("dp ranks", (ValueError, OSError, RuntimeError, TimeoutError)):
            link_dir = tempfile.mkdtemp(prefix="prefill-worker-dp-")  # mode 0700
            relay = Relay(link_dir, size, self._reply)
            self._dp_inbox.relay = relay
            if shares_experts(cfg):  # rung by a rank with a plan (dp.lockstep)
                self._bell = Bell(bell_path(link_dir), listen=True)
            here = Placement(0, size, 0, 0, False)
            device = rank_device(cfg.model.device, here)
            store = open_store(here, tp_timeouts(cfg))
            assert store is not None
            secret = os.urandom(32)
            command = (*DP_RANK_COMMAND, "--link", relay.endpoint)
            config_json = cfg.model_dump_json().encode()
            followers = Followers.start(command, config_json, size, store.port, secret)
            stop_s = cfg.parallel.step_timeout_s + cfg.parallel.heartbeat_interval_s
            self._ranks = DpRanks(relay, followers, link_dir, stop_s)
            self.health.watch_group(self._ranks.stuck)
            self._membership = followers.wait_for(
                lambda: join(here, device, tp_timeouts(cfg), store, secret),
                cfg.parallel.rendezvous_timeout_s,
                "dp rendezvous",
            )
        log.info("attention DP: %d ranks joined, this is rank 0", size)

    def _load(self, placement: Placement | None) -> tuple[ModelRunner, KVCache, ModelInfo]:
        """Experts shared over the DP ranks: the model over the DP world, every forward in
        lockstep with the other ranks' (``dp.lockstep``); else rank 0's own model."""
        if not shares_experts(self.config):
            return super()._load(placement)
        ranks, membership, bell = self._ranks, self._membership, self._bell
        assert ranks is not None and membership is not None and bell is not None
        timeout_s = self.config.parallel.rendezvous_timeout_s

        def bound(work: Callable[[], Any]) -> Any:
            return ranks.followers.wait_for(work, timeout_s, "dp ranks loaded")

        report = LoadReport(self.notifier.status)
        lockstep, kv_cache, info = load_in_lockstep(
            self.config, self._build_model, report, membership, bell, bound, self._wake.set
        )
        ranks.lockstep = lockstep
        return lockstep, kv_cache, info

    def _start_front(self, engine: Engine, limits: tuple[int, int, int]) -> Ingress:
        self.registry.register(DpLoadCollector(lambda: self._rank_loads(engine)))
        load = lambda: combined(self._rank_loads(engine))  # noqa: E731
        on_drain = self.request_drain
        return start_ingress(self.config, self.inbox, load, limits, self.metrics, on_drain)

    def _rank_loads(self, engine: Engine) -> list[LoadSnapshot]:
        assert self._ranks is not None
        loads, size = self._ranks.relay.loads, self.config.parallel.dp_size
        return [engine.load, *(loads.get(r, LoadSnapshot()) for r in range(1, size))]

    def _more_endpoints(self) -> dict[str, object]:
        assert self._ranks is not None
        ranks = self._ranks
        with startup_step("dp ranks ready", (RuntimeError, TimeoutError)):
            timeout_s = self.config.parallel.rendezvous_timeout_s
            if not ranks.followers.wait_for(
                lambda: ranks.relay.wait_ready(timeout_s), timeout_s, "dp ranks ready"
            ):
                raise TimeoutError(f"not every dp rank served within {timeout_s:g} s")
        known = ranks.relay.endpoints
        serve_own_rooms(self._transfer_backend, 0, ranks.relay.dp_size)
        self._lead_sglang([dict(self.transfer_endpoints), *(known[r] for r in sorted(known))])
        return {"dp_size": ranks.relay.dp_size, "dp_ranks": [known[r] for r in sorted(known)]}

    def _lead_sglang(self, endpoints: list[Mapping[str, object]]) -> None:
        """SGLang's routes on rank 0 name every rank's control socket, by its dp group."""
        if self.config.transfer.protocols != ("sglang",):
            return
        from prefill_worker.transfer.sglang.backend import SglangBackend

        backend = self._transfer_backend
        assert isinstance(backend, SglangBackend), "sglang alone: the backend is its own"
        infos: list[dict[str, object]] = []
        for ends in endpoints:
            host, _, port = str(ends["sglang_control"]).rpartition(":")
            infos.append({"rank_ip": host.removeprefix("tcp://"), "rank_port": int(port)})
        backend.lead_dp(infos, self.rooms.query)

    def _supervisor(self) -> Supervisor:
        assert self._engine is not None and self._engine_thread is not None
        serving = Serving(
            self._engine, self._engine_thread, self.inbox, self.ingress, self._http_api, self._ranks
        )
        cfg, requests = self.config.daemon, self.stop_requests
        return Supervisor(cfg, serving, requests, self.health, self.metrics, self.notifier)

    def _close(self) -> None:
        if self._ranks is not None:  # before the fronts go: rank requests are answered first
            self._ranks.close()
        super()._close()
