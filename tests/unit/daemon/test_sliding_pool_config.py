"""``cache.sliding_pool``: check-config's arithmetic of a windowed sliding pool (its pages, its
bytes, the pool left with the full layers), its problems, and start-up's refusal (exit 78)
where no transfer reads the sliding page space (vLLM decodes from another layout or at TP >
1; TP or DP > 1 over any protocol but native)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefill_worker.kv.sliding import max_pages_per_request
from prefill_worker.service.checkmodel import check_model
from prefill_worker.service.config import EX_CONFIG, load_config
from prefill_worker.service.sliding_pool import windowed_refusal
from prefill_worker.service.startup import StartupError, load_model
from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("gpt_oss", tmp_path_factory.mktemp("swa_cfg") / "gpt_oss")


def config(path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    base = [f"model.path={path}", "model.dtype=float32", "cache.page_size=16"]
    return load_config(ROOT / "configs" / "tiny-test.yaml", env={}, overrides=[*base, *overrides])


VLLM = ("transfer.protocol=vllm", "http_api.enabled=true")
VLLM_34 = (*VLLM, 'transfer.vllm_versions=["0.34.0"]')


def pool_note(notes: list[str]) -> str:
    return next(n for n in notes if n.startswith("KV pool:"))


def test_windowed_sizes_the_sliding_pool_and_the_pool_without_its_layers(gpt_oss: Path) -> None:
    cfg = config(gpt_oss, "cache.sliding_pool=windowed", "scheduler.chunk_size=64",
                 "scheduler.max_running_requests=4", "cache.num_pages=null",
                 "cache.memory_bytes=1000000")  # fmt: skip
    check = check_model(cfg)
    assert not check.problems, check.problems
    quota = max_pages_per_request(24, 64, 16)  # the tiny checkpoint's window is 24
    (note,) = [n for n in check.notes if n.startswith("sliding pool (windowed)")]
    assert f"2 sliding layers × {4 * quota} pages" in note and "1 full layers" in note
    layer_page = 16 * 2 * 12 * 4  # page_size × 2 KV heads × head_dim 12 × fp32
    reserved = 4 * quota * 2 * 2 * layer_page
    assert f"1000000 - {reserved} (sliding pool)" in " ".join(check.notes)
    pages = (1000000 - reserved) // (2 * layer_page)  # K and V of the one full layer
    assert pool_note(check.notes).startswith(f"KV pool: {pages} pages")
    full = check_model(config(gpt_oss))
    assert not [n for n in full.notes if n.startswith("sliding pool")]


def test_a_sliding_pool_under_one_quota_is_a_problem(gpt_oss: Path) -> None:
    cfg = config(gpt_oss, "cache.sliding_pool=windowed", "cache.sliding_pages=3")
    assert any("cache.sliding_pages 3" in p for p in check_model(cfg).problems)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ((*VLLM_34, "cache.layout=page_major"), "layer_major pool"),
        ((*VLLM_34, "parallel.tp_size=2"), "vLLM decodes are staged from it at parallel.tp_size 1"),
        (("transfer.protocol=sglang", "parallel.tp_size=2"), "tp_size 2, dp_size 1: served"),
        (("transfer.protocol=sglang", "parallel.dp_size=2"), "tp_size 1, dp_size 2: served"),
    ],
)
def test_start_up_refuses_windowed_where_no_transfer_reads_it(
    gpt_oss: Path, overrides: tuple[str, ...], why: str
) -> None:
    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded")

    with pytest.raises(StartupError) as refused:
        load_model(config(gpt_oss, "cache.sliding_pool=windowed", *overrides), never)
    assert refused.value.exit_code == EX_CONFIG
    assert why in str(refused.value)


@pytest.mark.parametrize("protocol", ["sglang", "native", "both", "vllm", "native,sglang,vllm"])
def test_start_up_loads_windowed_for_native_sglang_and_vllm_0_34(
    gpt_oss: Path, protocol: str
) -> None:
    cfg = config(gpt_oss, "cache.sliding_pool=windowed", *VLLM_34, f"transfer.protocol={protocol}")
    assert windowed_refusal(cfg) is None
    # 0.33.0 listed too (the default list): its requests are refused one by one, as from a
    # full pool (Tickets.why_refused), so start-up does not refuse the worker
    assert windowed_refusal(config(gpt_oss, "cache.sliding_pool=windowed", *VLLM)) is None


@pytest.mark.parametrize("parallel", ["parallel.tp_size=2", "parallel.dp_size=2"])
def test_start_up_loads_windowed_over_native_at_tp_or_dp_2(gpt_oss: Path, parallel: str) -> None:
    cfg = config(gpt_oss, "cache.sliding_pool=windowed", "transfer.protocol=native", parallel)
    assert windowed_refusal(cfg) is None
