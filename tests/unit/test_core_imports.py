"""The core (config, the shared vocabulary, the scheduler, KV bookkeeping, the router wire, the
transfer seam) must import with torch, ZMQ and NIXL absent, so the state machine stays testable
in milliseconds. A module named here that does not exist fails the test: a rename must not
quietly stop the check."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import prefill_worker

BLOCKED = ("torch", "zmq", "nixl", "nixl_cu12", "flashinfer", "transformers")
CORE_PACKAGES = ("scheduler", "kv")
CORE_MODULES = (
    "prefill_worker.service.config",
    "prefill_worker.service.configdoc",
    "prefill_worker.request",
    "prefill_worker.batch",
    "prefill_worker.inbox",
    "prefill_worker.load",
    "prefill_worker.ingress.messages",
    "prefill_worker.ingress.validate",
    "prefill_worker.transfer.base",
)

_BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: the core must not import it")
        return None
sys.meta_path.insert(0, Blocker())
import importlib
for name in {modules!r}:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("ok", len({modules!r}))
"""


def core_modules() -> list[str]:
    root = Path(prefill_worker.__file__).parent
    found = list(CORE_MODULES)
    for package in CORE_PACKAGES:
        found.append(f"prefill_worker.{package}")
        for info in pkgutil.walk_packages([str(root / package)], f"prefill_worker.{package}."):
            found.append(info.name)
    return found


def _exists(module: str) -> bool:
    path = Path(prefill_worker.__file__).parent.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_core_module_named_exists() -> None:
    named = [*CORE_MODULES, *(f"prefill_worker.{p}" for p in CORE_PACKAGES)]
    missing = [m for m in named if not _exists(m)]
    assert not missing, f"core modules named here do not exist: {missing}"


def test_core_imports_without_torch_zmq_nixl() -> None:
    modules = core_modules()
    code = _BLOCKER.format(blocked=BLOCKED, modules=modules)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_blocker_catches_a_leak() -> None:
    code = _BLOCKER.format(blocked=BLOCKED, modules=["json", "zmq"])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "blocked" in proc.stderr
