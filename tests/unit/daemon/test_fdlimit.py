"""``raise_fd_limit``: the soft open-file limit goes up to the hard one (in a child process,
so this test's own limit is left alone)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import resource
from prefill_worker.service.fdlimit import raise_fd_limit
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
assert raise_fd_limit() == hard
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
assert raise_fd_limit() == hard  # already there: nothing to do
print("ok")
"""


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
