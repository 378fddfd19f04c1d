"""``check-config`` prints the weight memory from config.json: DeepSeek-V3's FP8 release
(model_configs/deepseek-v3.json with the ``quantization_config`` DeepSeek ships) and Qwen3-8B
unquantized. The totals are the published ones (DeepSeek-V3: 671 B parameters without its
multi-token-prediction layer, which the worker does not load; Qwen3-8B: 8.2 B); per rank,
a split matrix counts 1/tp and a replicated one (embeddings, lm_head, router, q_a, kv_a) whole.
On CUDA the block-scaled FP8 GEMM keeps every FP8 matrix but kv_b (dense for the attention
backends) and kv_a (576 rows: not whole 128-blocks) in FP8: 82.31 GiB were all kept, + kv_b's
61 × 32768 × 512 / 8 and kv_a's 61 × 576 × 7168 parameters at 1 byte more = 82.67 GiB; on a
CPU everything is dequantized (160.94 GiB)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefill_worker.service.cli import main
from tests.unit.deploy.tools import ROOT

MODEL_CONFIGS = Path(__file__).parent / "model_configs"
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}  # fmt: skip


def checkpoint(tmp_path: Path, model_config: str, **extra: object) -> Path:
    raw = json.loads((MODEL_CONFIGS / model_config).read_text()) | extra
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return tmp_path


def check(config: str, *sets: str, capsys: pytest.CaptureFixture[str]) -> str:
    args = [f"configs/{config}", "--require-model"]
    for item in sets:
        args += ["--set", item]
    code = main(["check-config", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture(autouse=True)
def _at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_deepseek_v3_fp8_at_tp8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint(tmp_path, "deepseek-v3.json", quantization_config=DEEPSEEK_FP8)
    out = check("moonlight-16b-a3b-h200.yaml", f"model.path={model}", "parallel.tp_size=8",
                "transfer.protocol=sglang", capsys=capsys)  # fmt: skip
    assert (
        "weights: 671.03 B parameters; as shipped (quant_method fp8, block 128 × 128): 669.07 B "
        "FP8 = 623.12 GiB + scales 0.15 GiB + 1.96 B others = 3.65 GiB, in all 626.92 GiB; "
        "resident per rank (TP 8) on CUDA: 82.67 GiB with the block-scaled FP8 GEMM (84.06 B "
        "parameters kept in FP8, the rest in bfloat16); where the GEMM is not selected (not "
        "compute capability 9.x, or torch without blockwise scaled_mm) dequantized at load in "
        "bfloat16: 160.94 GiB"
    ) in out


def test_deepseek_v3_fp8_on_a_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint(tmp_path, "deepseek-v3.json", quantization_config=DEEPSEEK_FP8)
    out = check("moonlight-16b-a3b-h200.yaml", f"model.path={model}", "parallel.tp_size=8",
                "transfer.protocol=sglang", "model.device=cpu", "model.attention_backend=sdpa",
                "model.moe_backend=grouped", capsys=capsys)  # fmt: skip
    assert (
        "resident per rank (TP 8) in bfloat16: 160.94 GiB, dequantized at load (on a CPU; on a "
        "Hopper GPU 82.67 GiB with the block-scaled FP8 GEMM (84.06 B parameters kept in FP8, "
        "the rest in bfloat16))"
    ) in out


def test_the_deepseek_v3_fp8_node_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/deepseek-v3-fp8-8xh200.yaml (TP 8 from the file): its comments' arithmetic."""
    model = checkpoint(tmp_path, "deepseek-v3.json", quantization_config=DEEPSEEK_FP8)
    out = check("deepseek-v3-fp8-8xh200.yaml", f"model.path={model}", capsys=capsys)
    assert "resident per rank (TP 8) on CUDA: 82.67 GiB with the block-scaled FP8 GEMM" in out
    assert "dequantized at load in bfloat16: 160.94 GiB" in out
    assert "669.07 B FP8 = 623.12 GiB + scales 0.15 GiB + 1.96 B others = 3.65 GiB" in out
    assert "70272 bytes of KV per token (61 layers)" in out
    assert "30559 pages × 16 tokens = 488944 tokens, 32.00 GiB" in out


def test_unquantized_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint(tmp_path, "qwen3-8b.json")
    out = check("qwen3-8b-h100.yaml", f"model.path={model}", capsys=capsys)
    assert (
        "weights: 8.19 B parameters, 15.26 GiB in the checkpoint; resident per rank (TP 1) in "
        "bfloat16: 15.26 GiB"
    ) in out


def test_channel_scales_and_a_float32_model(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                 "strategy": "channel"}}}}  # fmt: skip
    model = checkpoint(tmp_path, "qwen3-8b.json", quantization_config=quant)
    out = check("qwen3-8b-h100.yaml", f"model.path={model}", "model.dtype=float32",
                "parallel.tp_size=2", "transfer.protocol=sglang", capsys=capsys)  # fmt: skip
    # the FP8 matrices' rows: 36 layers × (q 4096 + k, v 2 × 1024 + o 4096 + gate, up 2 ×
    # 12288 + down 4096) = 36 × 38912 channels × 4 bytes = 5.34 MiB = 0.01 GiB
    assert "as shipped (quant_method compressed-tensors, channel): 6.95 B FP8" in out
    assert "+ scales 0.01 GiB" in out
    # per rank: 6.95 B linear / 2 + the embeddings and lm_head whole (2 × 151936 × 4096 =
    # 1.245 B) + norms = 4.72 B × 4 bytes
    assert "resident per rank (TP 2) in float32: 17.58 GiB" in out


def test_an_fp8_kv_pool_halves_the_bytes_per_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-8B's 36 layers × 2 × 8 KV heads × 128: 147456 bytes a token in bf16, 73728 in
    FP8, so the same 48 GiB budget holds twice the pages."""
    model = checkpoint(tmp_path, "qwen3-8b.json")
    out = check("qwen3-8b-h100.yaml", f"model.path={model}", "cache.kv_dtype=fp8_e4m3",
                capsys=capsys)  # fmt: skip
    assert "36 layers, fp8_e4m3; KV per token per layer" in out
    assert "2048 values, 2048 bytes; 73728 bytes of KV per token (36 layers)" in out
    assert "43690 pages × 16 tokens = 699040 tokens, 48.00 GiB" in out


def test_a_tp_size_that_cuts_a_block_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-4B-FP8's MLP width (9728) at TP 8: 1216 rows a rank, 9.5 blocks; the loader's
    block GEMM refuses it (placement.check_cuts), which check-config says on CUDA."""
    model = checkpoint(tmp_path, "qwen3-8b.json", quantization_config=DEEPSEEK_FP8,
                       intermediate_size=9728)  # fmt: skip
    out = check("qwen3-8b-h100.yaml", f"model.path={model}", "parallel.tp_size=8",
                "transfer.protocol=sglang", capsys=capsys)  # fmt: skip
    assert (
        "on CUDA: the block-scaled FP8 GEMM refuses TP 8 at load: a 9728 × 4096 matrix leaves "
        "1216 rows a rank, not whole 128-blocks"
    ) in out
    out = check("qwen3-8b-h100.yaml", f"model.path={model}", "parallel.tp_size=4",
                "transfer.protocol=sglang", capsys=capsys)  # fmt: skip
    assert "refuses" not in out and "with the block-scaled FP8 GEMM" in out
