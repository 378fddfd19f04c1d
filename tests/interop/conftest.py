"""Interop with SGLang's own decode-side code: each pinned SGLang version (``make interop-deps``
installs them under ``.interop/``) runs as the decode in a child process
(``prefill_worker.testing.sglang_decode``), against this worker's SGLang protocol.

Every test module here is marked ``interop`` and runs once per version (``PW_SGLANG_VERSIONS``,
default the supported range); a version that is not installed skips with the command that
installs it. ``make test`` leaves them out; ``make interop`` runs them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
INTEROP_DIR = Path(os.environ.get("PW_INTEROP_DIR", ROOT / ".interop"))
VERSIONS = os.environ.get("PW_SGLANG_VERSIONS", "0.5.20 0.5.22 0.5.23").split()
STUBS = Path(__file__).resolve().parent / "stubs"


def sglang_path(version: str) -> list[Path]:
    """PYTHONPATH of the decode child for one version; skips the test when not installed."""
    target = INTEROP_DIR / f"sglang-{version}"
    deps = INTEROP_DIR / "deps"
    missing = [p for p in (target, deps) if not (p / ".installed").exists()]
    if missing:
        pytest.skip(
            f"SGLang {version} interop environment missing ({', '.join(map(str, missing))}): "
            "run `make interop-deps`"
        )
    return [ROOT, target, deps, STUBS]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("interop-ckpt") / "llama")


@pytest.fixture(scope="session", params=VERSIONS)
def sglang_version(request: pytest.FixtureRequest) -> str:
    version: str = request.param
    sglang_path(version)  # skip early, before anything starts
    return version


def start_decode(version: str, checkpoint: Path, log_dir: Path) -> SglangDecodeProcess:
    return SglangDecodeProcess(
        sys.executable, sglang_path(version), checkpoint, log_dir / f"decode-{version}.log"
    )


@pytest.fixture(scope="session")
def decode_process(
    sglang_version: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangDecodeProcess]:
    """One child per version; each test makes its own decodes in it (``new``)."""
    child = start_decode(sglang_version, checkpoint, tmp_path_factory.mktemp("decode"))
    yield child
    child.close()
