"""A warm spare of the worker process, for restart tests and benchmarks: a test tool.

``python -m prefill_worker.testing.spare serve CONFIG --set ...`` imports what the worker
imports (seconds on a busy machine), prints ``spare: waiting for SIGUSR1``, waits for that
signal, then runs the worker's own CLI with those arguments (``prefill-worker serve ...``):
the same process a restart starts, only without the import time, so a test can restart a
worker within the second its predecessor exited.
"""

from __future__ import annotations

import signal
import sys

# What the worker imports, now rather than after the signal.
from prefill_worker.service import cli, daemon  # noqa: F401
from prefill_worker.transfer.sglang import backend  # noqa: F401

WAITING = "spare: waiting for SIGUSR1"


def main(argv: list[str]) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print(WAITING, flush=True)
    signal.sigwait({signal.SIGUSR1})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
