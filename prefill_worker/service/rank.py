"""A follower rank's process: join the group, load this rank's shard, run the leader's steps.

Started by the leader (``tp/followers.py``) as ``python -m prefill_worker.service.rank
--rank R --world-size N --port P --parent-pid PID`` with the resolved configuration as JSON
on stdin, or reached from ``prefill-worker serve`` under torchrun when RANK is not 0. Where
the worker serves one protocol, native or SGLang's, it pushes its own KV heads through its
own NIXL agent (``transfer.nixl.rank_backend``), replaying the leader's senders
(``tp.mirror``); where it serves vLLM's, its forwards write its heads into the staging region
the group shares (``service.vllm_group``). It
ignores SIGTERM and SIGINT (a supervisor signals the whole process group; the leader drains
and then sends the stop step) and dies with its leader. Exit codes: 0 after a stop step, 78
for a configuration problem, 1 for anything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import uuid
from collections.abc import Sequence

from prefill_worker.batch import ModelRunner
from prefill_worker.kv.layout import KVRegions
from prefill_worker.model import build
from prefill_worker.model.draft.runner import DraftingRunner
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.service.config import EX_CONFIG, Config
from prefill_worker.service.fdlimit import raise_fd_limit, start_listener_guard
from prefill_worker.service.group_startup import tp_timeouts
from prefill_worker.service.logs import configure_logging
from prefill_worker.service.startup import (
    ModelBuilder,
    SlidingModel,
    StartupError,
    load_model,
    sliding_model,
    windowed_pages_of,
)
from prefill_worker.service.teardown import prepare_exit
from prefill_worker.service.vllm_group import Unmirrored, follow_staging
from prefill_worker.tp.channel import FollowerChannel
from prefill_worker.tp.follower import serve_steps
from prefill_worker.tp.followers import die_with_parent, read_stdin
from prefill_worker.tp.group import Placement, agree_loaded, join, leave, rank_device
from prefill_worker.tp.mirror import MirrorTarget

log = logging.getLogger("prefill_worker.service.rank")


def run_follower(
    config: Config, placement: Placement, build_model: ModelBuilder, secret: bytes
) -> int:
    """Serve as rank ``placement.rank`` until the leader's stop step (main thread only)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the leader drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = rank_device(config.model.device, placement)
    except ValueError as exc:
        log.error("rank %d: %s", placement.rank, exc)
        return EX_CONFIG
    try:
        membership = join(placement, device, tp_timeouts(config), None, secret)
        runner, kv_cache, info = load_model(config, build_model, tp=membership.tp, device=device)
        agree_loaded(kv_cache.layout.num_pages)
        heads = info.num_kv_heads
        staging = follow_staging(config, kv_cache, heads, placement.rank, placement.size)
        steps: ModelRunner = runner
        if staging is not None and staging.heads is None:  # its head is another rank's
            steps = Unmirrored(runner)
        draft = runner.draft_kv.regions(0, 0) if isinstance(runner, DraftingRunner) else None
        target = _transfer_target(config, kv_cache, heads, placement, draft, sliding_model(info))
        channel = FollowerChannel(membership.control, placement.rank, placement.size)
        guard = start_listener_guard(config.transfer.ucx_silent_close_s)  # its agent's listener
        try:
            serve_steps(steps, channel, target, staging)
        finally:
            if guard is not None:
                guard.stop()
            if target is not None:
                target.close()
    except StartupError as exc:
        log.error("rank %d: %s", placement.rank, exc)
        return exc.exit_code
    except Exception:
        log.exception("rank %d failed", placement.rank)
        return 1
    leave()
    return 0


def _transfer_target(
    config: Config,
    kv_cache: KVCache,
    num_kv_heads: int,
    placement: Placement,
    draft: KVRegions | None = None,
    sliding: SlidingModel | None = None,
) -> MirrorTarget | None:
    """This rank's own transfer backend behind the mirror, for the native protocol or
    SGLang's (the configuration refuses any other choice at TP > 1: docs/parallelism.md),
    with its draft pool (``model.draft``) beside its target pool, and a windowed sliding
    pool's layers (native only: ``service.sliding_pool.windowed_refusal``)."""
    cfg = config.transfer
    if cfg.protocols not in (("native",), ("sglang",)):
        return None
    from prefill_worker.transfer.nixl.agent import make_agent
    from prefill_worker.transfer.nixl.rank_backend import RankBackend
    from prefill_worker.transfer.nixl.rank_writer import RankPlace

    name = f"{cfg.agent_name or 'prefill'}-rank{placement.rank}-{uuid.uuid4().hex[:8]}"
    is_native = cfg.protocols == ("native",)
    devices = cfg.resolved_ucx_net_devices if is_native else cfg.resolved_sglang_ucx_net_devices
    agent = make_agent(name, list(cfg.nixl_backends), devices)
    place = RankPlace(placement.rank, placement.size, num_kv_heads)
    regions = kv_cache.regions(0, 0)  # the aux rows are the leader's
    layers = None
    if is_native and sliding is not None:  # its sliding layers' own pages, if windowed
        layers = dataclasses.replace(sliding.layers, pool_pages=windowed_pages_of(regions, sliding))
    backend = RankBackend(agent, place, regions, cfg.peer_timeout_s, draft=draft, sliding=layers)
    return MirrorTarget(backend)


def main(argv: Sequence[str] | None = None, build_model: ModelBuilder = build) -> int:
    parser = argparse.ArgumentParser(prog="prefill_worker.service.rank")
    for flag in ("--rank", "--world-size", "--port", "--parent-pid"):
        parser.add_argument(flag, type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    secret, config_json = read_stdin(sys.stdin.buffer.read())
    config = Config.model_validate_json(config_json)
    configure_logging(config.daemon.log_level, config.daemon.log_format)
    raise_fd_limit()
    placement = Placement(args.rank, args.world_size, args.rank, args.port, False)
    code = run_follower(config, placement, build_model, secret)
    prepare_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())
