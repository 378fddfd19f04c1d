"""How long a worker's process lives after its last log line (``daemon: exit N``).

Every stop, and so every restart, waits for it. The worker runs ``configs/tiny-test.yaml``
(a tiny random Llama, built here) and is stopped with SIGTERM once ready, ``--runs`` times;
per run, from the moment this process sees the exit line to the moment the worker is a
zombie, the wall time and the CPU the worker spent (its ``/proc`` times: on a loaded machine
the wall time mostly measures the wait for a core). One JSON line per run and a summary, to
stdout and ``bench/results/exit_time.jsonl`` (appended, with the load average):

    {"name": "exit_time", "run", "exit_code", "wall_s", "cpu_s", "load"}
    {"name": "exit_time", "summary": true, "wall_s_median", "cpu_s_median", "runs", "load"}

Goal (docs/reliability.md): a small fraction of a second of CPU after the line (it was ~0.7 s
before ``service/teardown.py`` froze the heap).

    python bench/exit_time.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e

from tests.checkpoints import make_checkpoint

EXIT_LINE = re.compile(r"daemon: exit -?\d+$", re.MULTILINE)
READY = "ready:"


def proc_times(pid: int) -> tuple[str, float]:
    """A live or zombie process's state letter and CPU seconds (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(checkpoint: Path, log: Path) -> tuple[int, float, float]:
    """(exit code, wall s, CPU s) after the exit line of one SIGTERMed worker."""
    args = [sys.executable, "-m", "prefill_worker", "serve", "configs/tiny-test.yaml"]
    args += ["--set", f"model.path={checkpoint}", "--set", "ingress.bind=tcp://127.0.0.1:0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while READY not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not get ready:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)  # a bench's poll of a log file, not a test's synchronisation
    proc.send_signal(signal.SIGTERM)
    seen: tuple[float, float] | None = None
    while True:
        state, cpu_s = proc_times(proc.pid)
        if seen is None and EXIT_LINE.search(log.read_text(errors="replace")):
            seen = (time.monotonic(), cpu_s)
        if state == "Z":
            break
        time.sleep(0.005)
    end = time.monotonic()
    seen = seen or (end, cpu_s)
    return proc.wait(), end - seen[0], cpu_s - seen[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    lines: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-exit-") as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = make_checkpoint("llama", tmp / "llama")
        for run in range(args.runs):
            code, wall_s, cpu_s = one_run(checkpoint, tmp / f"worker-{run}.log")
            lines.append(
                {
                    "name": "exit_time",
                    "run": run,
                    "exit_code": code,
                    "wall_s": round(wall_s, 3),
                    "cpu_s": round(cpu_s, 3),
                    "load": round(os.getloadavg()[0], 1),
                }
            )
    summary = {
        "name": "exit_time",
        "summary": True,
        "wall_s_median": statistics.median(float(x["wall_s"]) for x in lines),  # type: ignore[arg-type]
        "cpu_s_median": statistics.median(float(x["cpu_s"]) for x in lines),  # type: ignore[arg-type]
        "runs": args.runs,
        "load": round(os.getloadavg()[0], 1),
    }
    e2e.write_lines([*lines, summary], e2e.RESULTS / "exit_time.jsonl", append=True)
    return 0 if all(x["exit_code"] == 0 for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
