"""A follower's loop: run each step the leader sends, answer it, until STOP.

A follower never schedules, samples for anyone or talks to a router: it holds its shard of
the weights and its KV heads, and runs the leader's plans on them. Any error ends the
process (non-zero): the group cannot continue a half-run forward, and the leader finds the
closed socket at its next collective.
"""

from __future__ import annotations

import logging
import time

from prefill_worker.batch import ModelRunner
from prefill_worker.tp.channel import FollowerChannel
from prefill_worker.tp.step import StepKind, decode_plan

log = logging.getLogger(__name__)


def serve_steps(runner: ModelRunner, channel: FollowerChannel) -> None:
    """Returns at STOP; raises on any failure (the caller exits non-zero)."""
    while True:
        kind, payload = channel.receive()
        if kind is StepKind.STOP:
            log.info("tensor parallel: stop step: leaving")
            return
        forward_s = 0.0
        if kind is StepKind.FORWARD:
            started = time.perf_counter()
            runner.run(decode_plan(payload))
            forward_s = time.perf_counter() - started
        channel.answer(forward_s)
