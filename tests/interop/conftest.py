"""Interop with SGLang's own decode-side code: each pinned SGLang version (``make interop-deps``
installs them under ``.interop/``) runs as the decode in a child process
(``prefill_worker.testing.sglang_decode``), against this worker's SGLang protocol.

Every test module here is marked ``interop`` and runs once per version (``PW_SGLANG_VERSIONS``,
default the supported range); a version that is not installed skips with the command that
installs it. ``make test`` leaves them out; ``make interop`` runs them.

Tests marked ``newest_sglang`` (those of TP-2 workers and attention-TP-2 decodes) run on the
newest version only: what differs between versions is the wire (the registration's frame
count, the abort's generation), which the unmarked tests cover on every version, and each
marked one starts rank processes. They skip at collection, so an older version starts none of
their fixtures. ``PW_INTEROP_ALL=1`` runs every test on every version.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefill_worker.kv.layout import KVLayout
from prefill_worker.testing.launch import free_port
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from tests.checkpoints import make_checkpoint
from tests.integration.daemon.conftest import Worker, start_worker
from tests.interop.vllm_decode import (
    VLLM_PUSH_VERSIONS,
    VLLM_VERSIONS,
    VllmDecodeProcess,
    vllm_pythonpath,
)
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
INTEROP_DIR = Path(os.environ.get("PW_INTEROP_DIR", ROOT / ".interop"))
VERSIONS = os.environ.get("PW_SGLANG_VERSIONS", "0.5.20 0.5.22 0.5.23").split()
EVERY_TEST_ON_EVERY_VERSION = os.environ.get("PW_INTEROP_ALL") == "1"
STUBS = Path(__file__).resolve().parent / "stubs"
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16  # tests/checkpoints.py, llama


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A ``newest_sglang`` test of an older version skips (module docstring)."""
    if EVERY_TEST_ON_EVERY_VERSION:
        return
    skip = pytest.mark.skip(
        reason="runs on the newest pinned version (PW_INTEROP_ALL=1: every one)"
    )
    for item in items:
        callspec = getattr(item, "callspec", None)
        version = callspec.params.get("sglang_version") if callspec else None
        if version not in (None, VERSIONS[-1]) and item.get_closest_marker("newest_sglang"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("interop-ckpt") / "llama")


@pytest.fixture(scope="session", params=VERSIONS)
def sglang_version(request: pytest.FixtureRequest) -> str:
    version: str = request.param
    sglang_path(version)  # skip early, before anything starts
    return version


def start_decode(
    version: str, checkpoint: Path, log_path: Path, overrides: dict[str, str] | None = None
) -> SglangDecodeProcess:
    """The child starts importing SGLang at once; its first ``call`` waits for it."""
    path = sglang_path(version)
    return SglangDecodeProcess(sys.executable, path, checkpoint, log_path, overrides=overrides)


@dataclass(frozen=True)
class Served:
    """A worker speaking SGLang's protocol, and a decode pool that fits it."""

    worker: Worker
    sglang: str  # host:port of the bootstrap routes
    layout: KVLayout

    def ready(self) -> Served:
        self.worker.child.wait_ready(120)
        return self


def launch(
    tmp_path: Path,
    checkpoint: Path,
    page_size: int,
    dtype: str,
    protocol: str,
    pool_layout: str = "layer_major",
    *settings: str,
    sglang: str | None = None,
    module: str = "prefill_worker",
) -> Served:
    """``prefill-worker serve`` on the tiny config, SGLang's protocol on; not waited for.
    ``pool_layout`` is the worker's (``cache.layout``); SGLang decodes are layer-major.
    ``sglang``: the bootstrap routes' host:port (default a free one). The rejoin window is
    off (``sglang_rejoin_s=0``) unless ``settings`` say otherwise: only restarts need it."""
    sglang = sglang or f"127.0.0.1:{free_port()}"
    worker = start_worker(
        tmp_path,
        checkpoint,
        f"transfer.protocol={protocol}",
        f"transfer.sglang_bootstrap_bind={sglang}",
        f"model.dtype={dtype}",
        f"cache.page_size={page_size}",
        f"cache.layout={pool_layout}",
        f"cache.num_pages={4096 // page_size}",
        f"scheduler.chunk_size={2 * max(page_size, 16)}",  # prompts go in several chunks
        "transfer.sglang_rejoin_s=0",
        *settings,
        module=module,
    )
    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, page_size, 2048 // page_size)
    return Served(worker, sglang, layout)


def launch_tp(directory: Path, checkpoint: Path, tp_size: int) -> Served:
    """``launch`` at ``parallel.tp_size`` ``tp_size`` (pages of 16, fp32, layer-major, SGLang's
    protocol), in ``directory`` (made if missing); not waited for. Optimistic prefill off: a
    prompt's chunks are then the same whenever its decode's want comes (a speculative prefill
    runs smaller chunks, within ``optimistic_share``, and fp32 K/V differ in their last bits
    with the chunking), so two workers' or two requests' pages compare byte for byte."""
    directory.mkdir(exist_ok=True)
    settings = (f"parallel.tp_size={tp_size}", "scheduler.optimistic_prefill=false")
    return launch(directory, checkpoint, 16, "float32", "sglang", "layer_major", *settings)


METRIC = re.compile(r"^(prefill_worker_(?:kv_pages|aux_rows)_used) (\S+)$", re.M)


def assert_pools_whole(worker: Worker) -> None:
    """Every KV page and aux row is back (the worker's /metrics says so once it has turned)."""

    def whole() -> bool:
        status, text = worker.http("/metrics")
        used = {name: float(value) for name, value in METRIC.findall(text)}
        return status == 200 and len(used) == 2 and not any(used.values())

    wait_until(whole, 20, "kv pages and aux rows back in the worker's pools")


@dataclass(frozen=True)
class Version:
    """What each version's tests use, started at once (an SGLang import takes seconds): the
    decode process every test makes its decodes in (the version's last test kills it:
    ``test_worker.py::test_decode_dies_and_the_worker_pools_are_whole``), and a worker that a
    test kills."""

    decode: SglangDecodeProcess
    doomed_worker: Served


@pytest.fixture(scope="session")
def version(
    sglang_version: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Version]:
    tmp_path = tmp_path_factory.mktemp(f"sglang-{sglang_version}")
    decode = start_decode(sglang_version, checkpoint, tmp_path / "decode.log")
    worker = launch(tmp_path, checkpoint, 16, "float32", "sglang")
    yield Version(decode, worker)
    worker.worker.child.kill()
    decode.close()


@pytest.fixture
def decode_process(version: Version) -> SglangDecodeProcess:
    if version.decode.popen.poll() is not None:
        pytest.fail("the version's decode process is gone: the test that kills it runs last")
    return version.decode


TP_SIZE = 2  # the decode's attention TP in the tests of decodes of TP > 1


@pytest.fixture(scope="session")
def rank_processes(
    sglang_version: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[SglangDecodeProcess]]:
    """A decode's two attention-TP ranks, one process each (started together), for every
    module that needs them (two SGLang imports cost about 1.5 min on CI's 2 cores); its tests
    are marked ``newest_sglang``."""
    path = sglang_path(sglang_version)
    tmp_path = tmp_path_factory.mktemp(f"ranks-{sglang_version}")
    processes = [
        SglangDecodeProcess(
            sys.executable, path, checkpoint, tmp_path / f"rank{r}.log", attn_tp=(r, TP_SIZE)
        )
        for r in range(TP_SIZE)
    ]
    yield processes
    for process in processes:
        process.close()


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM decode's model (``--model``): qwen3's head_dim 32 is one CPU_ATTN has; 2
    layers of 2 KV heads, what ``test_vllm_pull``'s minimal prefill registers too."""
    installed = [v for v in VLLM_VERSIONS if (INTEROP_DIR / f"vllm-{v}" / ".installed").exists()]
    if not installed:  # skip before writing anything (or starting a worker)
        vllm_pythonpath(VLLM_VERSIONS[0])
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("vllm-ckpt") / "qwen3")


@pytest.fixture(scope="session", params=VLLM_VERSIONS)
def vllm_decode(
    vllm_checkpoint: Path, request: pytest.FixtureRequest
) -> Iterator[VllmDecodeProcess]:
    """vLLM's NixlConnector of each version as a decode, started once for both vLLM modules
    (an import of vLLM takes ~40 s). Its 128 blocks are never freed: the modules use ~60
    together."""
    version = request.param
    vllm_pythonpath(version)  # skip before starting anything
    log_path = vllm_checkpoint.parent / f"decode-{version}.log"
    process = VllmDecodeProcess(vllm_checkpoint, log_path, num_blocks=128, version=version)
    assert process.call("info", timeout_s=300)["attn_backend_name"] == "CPU_ATTN"  # vLLM is up
    yield process
    process.close()


@pytest.fixture(scope="session")
def vllm_push_decodes(vllm_checkpoint: Path) -> Iterator[dict[str, VllmDecodeProcess]]:
    """vLLM's NixlPushConnector of each installed version of ``VLLM_PUSH_VERSIONS`` (the
    newest by default) as a decode, started together
    (each imports vLLM) once for the push tests (``test_vllm_push``, ``test_vllm_worker_tp``);
    their 128 blocks are never freed: those modules use ~90 together."""
    decodes = {}
    try:
        for version in VLLM_PUSH_VERSIONS:
            try:
                vllm_pythonpath(version)
            except pytest.skip.Exception:
                continue
            log = vllm_checkpoint.parent / f"push-decode-{version}.log"
            decodes[version] = VllmDecodeProcess(
                vllm_checkpoint,
                log,
                num_blocks=128,
                engine_id=f"vllm-push-decode-{version}",
                version=version,
                transfer_mode="push",
            )
        yield decodes
    finally:
        for process in decodes.values():
            process.close()
