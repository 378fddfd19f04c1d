"""configs/: every shipped configuration passes check-config, with its checkpoint absent (a
note says so) and, for the real targets, against the real model's config.json, whose KV
arithmetic matches what the file's comments claim.

model_configs/ holds each model's config.json as Hugging Face ships it, except
deepseek-v3.json, which lacks its FP8 ``quantization_config`` (as DeepSeek's bf16 conversion
writes it): the shapes are DeepSeek-V3's own."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefill_worker.model.hf_config import ARCHITECTURES
from prefill_worker.service.cli import main
from tests.unit.deploy.tools import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MODEL_CONFIGS = Path(__file__).parent / "model_configs"
# config file -> (the model's config.json here, what check-config must print)
REAL_TARGETS = {
    "llama-3.1-8b-h200.yaml": (
        "llama-3.1-8b-instruct.json",
        ["131072 bytes of KV per token", "40960 pages × 16 tokens = 655360 tokens, 80.00 GiB"],
    ),
    "qwen3-8b-h100.yaml": (
        "qwen3-8b.json",
        ["147456 bytes of KV per token", "21845 pages × 16 tokens = 349520 tokens, 48.00 GiB"],
    ),
    "qwen3-30b-a3b-h200.yaml": (
        "qwen3-30b-a3b.json",
        [
            "K and V: 2 × 4 KV heads × 128 = 1024 values, 2048 bytes;",
            "98304 bytes of KV per token (48 layers)",
            "64424509440 bytes / 1572864 bytes per page of 16 tokens = 40960 pages",
            "40960 pages × 16 tokens = 655360 tokens, 60.00 GiB",
            "experts: 128 routed, top 8, 0 shared, 48 of 48 layers sparse",
        ],
    ),
}
# MLA checkpoints (DeepseekV3ForCausalLM), checked through the DeepSeek-V3-shaped example:
# model config.json -> what check-config must print.
MLA_EXAMPLE = "configs/moonlight-16b-a3b-h200.yaml"
MLA_TARGETS = {
    "moonlight-16b-a3b.json": [
        "MLA latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values, 1152 bytes;",
        "31104 bytes of KV per token (27 layers)",
        "69042 pages × 16 tokens = 1104672 tokens, 32.00 GiB",
        "(K and V: 2 × 16 × 128 = 4096 values per layer) is 7.1× the 576-value latent",
    ],
    "deepseek-v3.json": [
        "MLA latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values, 1152 bytes;",
        "70272 bytes of KV per token (61 layers)",
        "34359738368 bytes / 1124352 bytes per page of 16 tokens = 30559 pages",
        "(K and V: 2 × 128 × 128 = 32768 values per layer) is 56.9× the 576-value latent "
        "(the latent is 1/56.9 of it)",
        "(128 × (128 + 64 + 128) = 40960 values) 71.1×",
    ],
}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def check_config(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``prefill-worker check-config ARGS`` in this process, from the repository root."""
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> Run:
        code = main(["check-config", *args])
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def checkpoint_dir(tmp_path: Path, model_config: str) -> Path:
    """config.json of the real model, and an (empty) weight index: what check-config reads."""
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(MODEL_CONFIGS / model_config, path / "config.json")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return path


def test_the_real_targets_are_shipped() -> None:
    assert set(REAL_TARGETS) <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_passes_without_its_checkpoint(config: Path, check_config) -> None:
    proc = check_config(str(config), "--set", "model.path=/nonexistent/model")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("config ok\n") and "was not checked" in proc.stdout


@pytest.mark.parametrize("name", sorted(REAL_TARGETS))
def test_real_targets_against_their_models(name: str, tmp_path: Path, check_config) -> None:
    model_config, expected = REAL_TARGETS[name]
    model = checkpoint_dir(tmp_path, model_config)
    proc = check_config(f"configs/{name}", "--require-model", "--set", f"model.path={model}")
    assert proc.returncode == 0, proc.stderr
    for line in expected:
        assert line in proc.stdout, proc.stdout


@pytest.mark.parametrize("model_config", sorted(MLA_TARGETS))
def test_mla_checkpoints_print_the_latent_arithmetic(
    model_config: str, tmp_path: Path, check_config
) -> None:
    """The arithmetic is printed whether or not this build serves the family yet: until
    DeepseekV3ForCausalLM is served, the check fails naming the architecture (exit 78)."""
    model = checkpoint_dir(tmp_path, model_config)
    proc = check_config(MLA_EXAMPLE, "--require-model", "--set", f"model.path={model}")
    out = proc.stdout + proc.stderr
    for line in MLA_TARGETS[model_config]:
        assert line in out, out
    if "DeepseekV3ForCausalLM" in ARCHITECTURES and model_config == "moonlight-16b-a3b.json":
        assert proc.returncode == 0, proc.stderr
    elif "DeepseekV3ForCausalLM" not in ARCHITECTURES:
        assert proc.returncode == 78 and "'DeepseekV3ForCausalLM'] is not supported" in out


def test_require_model_makes_an_absent_checkpoint_an_error(check_config) -> None:
    proc = check_config("configs/llama-3.1-8b-h200.yaml", "--require-model")
    assert proc.returncode == 78
    assert "config error: model.path '/models/Llama-3.1-8B-Instruct' is not a directory" in (
        proc.stderr
    )


def test_a_pool_smaller_than_the_longest_prompt_is_an_error(tmp_path: Path, check_config) -> None:
    model = checkpoint_dir(tmp_path, "qwen3-8b.json")
    proc = check_config(
        "configs/qwen3-8b-h100.yaml",
        "--set",
        f"model.path={model}",
        "--set",
        "cache.memory_bytes=1073741824",  # 455 pages = 7280 tokens < 32768
    )
    assert proc.returncode == 78
    assert "holds 7280 tokens, fewer than the longest prompt accepted (32768)" in proc.stderr


def test_a_checkpoint_without_weights_or_of_an_unknown_model_is_an_error(
    tmp_path: Path, check_config
) -> None:
    model = checkpoint_dir(tmp_path, "qwen3-8b.json")
    (model / "model.safetensors.index.json").unlink()
    proc = check_config("configs/qwen3-8b-h100.yaml", "--set", f"model.path={model}")
    assert proc.returncode == 78 and "neither model.safetensors" in proc.stderr
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    proc = check_config("configs/qwen3-8b-h100.yaml", "--set", f"model.path={model}")
    assert proc.returncode == 78 and "is not supported" in proc.stderr
