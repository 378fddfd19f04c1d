"""`scripts/gpu_check.sh --dry-run` runs here: the GPU check's plumbing (test collection, the
bench's prefill and two-process NIXL push, its JSON) works before a GPU is ever lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_passes_and_writes_bench_lines(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["name"] for line in lines] == ["gpu_prefill", "gpu_prefill", "gpu_transfer"]
    assert all(line["tok_s"] > 0 for line in lines[:2])
    assert lines[2]["byte_exact"] is True and lines[2]["gb_s"] > 0
