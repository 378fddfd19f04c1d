"""``model.moe_backend`` as the daemon's start-up reads it: the experts backend named in the
configuration is the one the model runs, ``auto`` is ``grouped`` on a CPU, and ``flashinfer``
on a CPU is a configuration error (exit 78) before any weight is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefill_worker.model import build
from prefill_worker.service.config import load_config
from prefill_worker.service.schema import Config
from prefill_worker.service.startup import StartupError, load_model
from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


def config_of(checkpoint: Path, *settings: str) -> Config:
    overrides = [f"model.path={checkpoint}", "cache.num_pages=8", *settings]
    return load_config(ROOT / "configs" / "tiny-test.yaml", env={}, overrides=overrides)


@pytest.mark.parametrize(("setting", "used"), [("naive", "naive"), ("auto", "grouped")])
def test_the_configured_experts_backend_is_the_one_the_model_runs(
    checkpoint: Path, setting: str, used: str
) -> None:
    runner, _, info = load_model(config_of(checkpoint, f"model.moe_backend={setting}"), build)
    assert runner.model.experts.name == used
    assert info.moe_backend == used


def test_flashinfer_on_a_cpu_is_a_configuration_error(checkpoint: Path) -> None:
    config = config_of(checkpoint, "model.moe_backend=flashinfer")
    with pytest.raises(StartupError, match="'flashinfer' needs a CUDA device") as caught:
        load_model(config, build)
    assert caught.value.exit_code == 78 and caught.value.step == "model load"
