"""The leader's hold on its follower processes, with real processes: a wait on the group ends
at once when a follower exits and at its deadline when one never answers, and a follower dies
with its leader however the leader ends (kill -9 included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefill_worker.tp.followers import Followers
from tests.polling import wait_until


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def test_a_wait_fails_at_once_when_a_follower_exits() -> None:
    proc = sleeper()
    followers = Followers([proc])
    never = threading.Event()
    try:
        proc.kill()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 .* exited with -9"):
            followers.wait_for(never.wait, timeout_s=60, what="rendezvous")
        assert time.monotonic() - started < 10
    finally:
        never.set()
        followers.kill()


def test_a_wait_ends_at_its_deadline_when_no_rank_answers() -> None:
    followers = Followers([sleeper()])
    never = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"within 0\.3 s"):
            followers.wait_for(never.wait, timeout_s=0.3, what="rendezvous")
    finally:
        never.set()
        followers.kill()


LEADER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(__import__("os").getpid())])
print(child.pid, flush=True)
child.wait()
"""
FOLLOWER = """
import sys, time
from prefill_worker.tp.followers import die_with_parent
die_with_parent(int(sys.argv[1]))
print("armed", flush=True)
time.sleep(120)
"""


def test_a_follower_dies_with_its_killed_leader(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, FOLLOWER], stdout=subprocess.PIPE, env=env, text=True
    )
    assert leader.stdout is not None
    follower_pid = int(leader.stdout.readline())
    assert leader.stdout.readline().strip() == "armed"
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()

    def gone() -> bool:
        try:
            state = Path(f"/proc/{follower_pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        return state == "Z"

    wait_until(gone, 10, "the follower to die with its leader")


def test_a_stopped_follower_is_named_until_it_is_continued() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    followers = Followers([proc])
    try:
        assert followers.first_stopped() is None
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: followers.first_stopped() is not None, 5, "the stop seen")
        assert followers.first_stopped() == f"rank 1 (pid {proc.pid}) is stopped"
        os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: followers.first_stopped() is None, 5, "the continue seen")
    finally:
        proc.kill()
        proc.wait()
    assert followers.first_stopped() is None  # gone: nothing to read
