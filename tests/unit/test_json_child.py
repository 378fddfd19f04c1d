"""The interop decodes' child process driver (``testing/json_child.JsonLineChild``): a call
that runs past its deadline fails alone; its late answer is never read as the next call's
(before the call numbers, one slow reply shifted every later reply by one: the CI run where
one SGLang decode call timed out under load failed 20 more with the wrong replies)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from prefill_worker.testing import launch
from prefill_worker.testing.json_child import DecodeError, JsonLineChild

CHILD = textwrap.dedent(
    """
    import json, sys, time
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "slow":
            time.sleep(1.0)  # past its caller's deadline, on any machine
        reply = {"ok": True, "op": command["op"], "call": command.get("call")}
        sys.stdout.write(json.dumps(reply) + "\\n")
        sys.stdout.flush()
        if command["op"] == "quit":
            break
    """
)


def test_a_late_answer_fails_its_call_only(tmp_path: Path) -> None:
    child = JsonLineChild([sys.executable, "-c", CHILD], {}, tmp_path / "child.log")
    try:
        with pytest.raises(DecodeError, match=r"slow: no answer within 0\.1 s"):
            child.call("slow", timeout_s=0.1 / launch.PATIENCE)  # 0.1 s whatever the patience
        assert child.call("fast", timeout_s=60)["op"] == "fast"  # not slow's late answer
        assert child.call("after", timeout_s=60)["op"] == "after"
    finally:
        child.close()
