"""A follower rank's process: join the group, load this rank's shard, run the leader's steps.

Started by the leader (``tp/followers.py``) as ``python -m prefill_worker.service.rank
--rank R --world-size N --port P --parent-pid PID`` with the resolved configuration as JSON
on stdin, or reached from ``prefill-worker serve`` under torchrun when RANK is not 0. It
ignores SIGTERM and SIGINT (a supervisor signals the whole process group; the leader drains
and then sends the stop step) and dies with its leader. Exit codes: 0 after a stop step, 78
for a configuration problem, 1 for anything else.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from prefill_worker.model import build
from prefill_worker.service.config import EX_CONFIG, Config
from prefill_worker.service.group_startup import tp_timeouts
from prefill_worker.service.logs import configure_logging
from prefill_worker.service.startup import ModelBuilder, StartupError, load_model
from prefill_worker.tp.channel import FollowerChannel
from prefill_worker.tp.follower import serve_steps
from prefill_worker.tp.followers import die_with_parent
from prefill_worker.tp.group import Placement, agree_loaded, join, leave, rank_device

log = logging.getLogger("prefill_worker.service.rank")


def run_follower(config: Config, placement: Placement, build_model: ModelBuilder) -> int:
    """Serve as rank ``placement.rank`` until the leader's stop step (main thread only)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the leader drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = rank_device(config.model.device, placement)
    except ValueError as exc:
        log.error("rank %d: %s", placement.rank, exc)
        return EX_CONFIG
    try:
        membership = join(placement, device, tp_timeouts(config), None)
        runner, kv_cache, _ = load_model(config, build_model, tp=membership.tp, device=device)
        agree_loaded(kv_cache.layout.num_pages)
        serve_steps(runner, FollowerChannel(membership.control, placement.rank, placement.size))
    except StartupError as exc:
        log.error("rank %d: %s", placement.rank, exc)
        return exc.exit_code
    except Exception:
        log.exception("rank %d failed", placement.rank)
        return 1
    leave()
    return 0


def main(argv: Sequence[str] | None = None, build_model: ModelBuilder = build) -> int:
    parser = argparse.ArgumentParser(prog="prefill_worker.service.rank")
    for flag in ("--rank", "--world-size", "--port", "--parent-pid"):
        parser.add_argument(flag, type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    config = Config.model_validate_json(sys.stdin.buffer.read())
    configure_logging(config.daemon.log_level, config.daemon.log_format)
    placement = Placement(args.rank, args.world_size, args.rank, args.port, False)
    return run_follower(config, placement, build_model)


if __name__ == "__main__":
    sys.exit(main())
