"""No tracked text file holds a merge-conflict marker (one reached docs/sglang.md once)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.MULTILINE)
_TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".sh", ".txt", ".service", ".cfg")


def test_no_tracked_file_has_a_conflict_marker() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    paths = [ROOT / p.decode() for p in listed if p and p.decode().endswith(_TEXT)]
    paths += [ROOT / "Makefile", ROOT / ".ci" / "run"]
    marked = [
        str(p.relative_to(ROOT)) for p in paths if p.is_file() and _MARKER.search(p.read_bytes())
    ]
    assert not marked, f"merge-conflict markers in {marked}"
