"""Where a pinned SGLang's decode-side code runs: the environment of a child process that
imports it (``make interop-deps`` installs each supported version under ``.interop/``; the
stand-ins for triton and torchvision are ``tests/interop/stubs``). A test and demo tool.

``sglang_env(root, version)`` is the child's environment (this interpreter, PYTHONPATH = the
checkout, that version, its shared dependencies, the stubs; SGLang's decode settings from
``sglang_decode.INTEROP_ENV``), or ``InteropMissing`` naming what to install.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from prefill_worker.testing.sglang_decode import INTEROP_ENV

DEFAULT_SGLANG_VERSION = "0.5.23"  # the newest of the supported range (docs/sglang.md)


class InteropMissing(RuntimeError):
    """The pinned SGLang environment is not installed; the text says how to install it."""


def sglang_pythonpath(root: Path, version: str = DEFAULT_SGLANG_VERSION) -> list[Path]:
    interop = Path(os.environ.get("PW_INTEROP_DIR", root / ".interop"))
    target, deps = interop / f"sglang-{version}", interop / "deps"
    missing = [str(p) for p in (target, deps) if not (p / ".installed").exists()]
    if missing:
        raise InteropMissing(
            f"SGLang {version} interop environment missing ({', '.join(missing)}): "
            "run `make interop-deps`"
        )
    return [root, target, deps, root / "tests" / "interop" / "stubs"]


def sglang_env(
    root: Path, version: str = DEFAULT_SGLANG_VERSION, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a process that imports SGLang ``version`` (InteropMissing if absent)."""
    path = sglang_pythonpath(root, version)
    env = {**(os.environ if base is None else base), **INTEROP_ENV}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return env
