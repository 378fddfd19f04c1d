"""Where the deploy tests find their tools: the venv's bin (``make setup`` installs kubectl,
hadolint and kubernetes-validate there), then PATH (promtool, systemd-analyze). A missing
tool skips its test, except under CI (``CI=true``), where ``make setup`` should have put it
there: then it fails."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent


def need(tool: str, installed_by: str) -> str:
    """The tool's path; or skip (fail under CI) saying what installs it."""
    local = VENV_BIN / tool
    if local.exists():
        return str(local)
    found = shutil.which(tool)
    if found is not None:
        return found
    message = f"{tool} is not installed ({installed_by})"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
