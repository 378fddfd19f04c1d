"""A follower's loop: run each step the leader sends, answer it, until STOP.

A follower never schedules, samples for anyone or talks to a router: it holds its shard of
the weights and its KV heads, and runs the leader's plans on them. Any error ends the
process (non-zero): the group cannot continue a half-run forward, and the leader finds the
closed socket at its next collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from prefill_worker.batch import ModelRunner
from prefill_worker.tp.channel import FollowerChannel
from prefill_worker.tp.mirror import MirrorTarget, no_opinion
from prefill_worker.tp.step import StepKind
from prefill_worker.transfer.vllm.shared import Stage

log = logging.getLogger(__name__)


class Stager(Protocol):
    """This rank's share of the leader's vLLM repacks (``service.vllm_group``)."""

    def apply(self, stages: Sequence[Stage]) -> None: ...


def serve_steps(
    runner: ModelRunner,
    channel: FollowerChannel,
    target: MirrorTarget | None = None,
    stager: Stager | None = None,
) -> None:
    """Returns at STOP; raises on any failure (the caller exits non-zero). ``target``: this
    rank's transfer backend, mirroring the leader's senders (None: no transfer here, no
    opinion on any room). ``stager``: where a step's vLLM stages go (before its forward,
    which may write the same blocks for a later request)."""
    while True:
        kind, step = channel.receive()
        if kind is StepKind.STOP or step is None:
            log.info("tensor parallel: stop step: leaving")
            return
        if stager is not None and step.stages:
            stager.apply(step.stages)
        if target is not None:
            target.apply(step.ops)
        forward_s = 0.0
        if step.plan is not None:
            started = time.perf_counter()
            runner.run(step.plan)
            forward_s = time.perf_counter() - started
        codes = no_opinion(len(step.rooms)) if target is None else target.codes(step.rooms)
        written = 0 if target is None else target.take_written_bytes()
        peers = 0 if target is None else target.num_peers
        channel.answer(forward_s, codes, written, peers)
