"""``cache.kv_dtype``: an FP8 pool must be announced to the decodes of every protocol served,
or the configuration is refused with the reason; and a native decode whose pool is not FP8
is refused at registration, naming both dtypes."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.service.config import ConfigError, load_config
from prefill_worker.transfer import wire
from prefill_worker.transfer.validate import BootstrapLimits, RejectReason, check_register


def problems(*flags: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=list(flags))
    return "\n".join(info.value.problems)


def test_fp8_with_native_or_an_announcing_sglang() -> None:
    assert load_config(None, env={}, overrides=["cache.kv_dtype=fp8_e4m3"]).cache.kv_dtype == (
        "fp8_e4m3"
    )
    flags = ["cache.kv_dtype=fp8_e4m3", "transfer.protocol=sglang",
             "transfer.sglang_kv_cache_dtype=fp8_e4m3"]  # fmt: skip
    assert load_config(None, env={}, overrides=flags).transfer.sglang_kv_cache_dtype == "fp8_e4m3"
    assert load_config(None, env={}, overrides=[]).cache.kv_dtype == "auto"


def test_sglang_must_announce_what_the_pool_holds() -> None:
    silent = problems("cache.kv_dtype=fp8_e4m3", "transfer.protocol=sglang")
    assert "cache.kv_dtype 'fp8_e4m3' with transfer.sglang_kv_cache_dtype 'auto'" in silent
    wrong = problems("transfer.protocol=sglang", "transfer.sglang_kv_cache_dtype=fp8_e4m3")
    assert "cache.kv_dtype 'auto' with transfer.sglang_kv_cache_dtype 'fp8_e4m3'" in wrong


VLLM = ("transfer.protocol=native,vllm", "http_api.enabled=true")


def test_vllm_decodes_must_hash_the_cache_dtype_the_pool_holds() -> None:
    for name in ("fp8", "fp8_e4m3"):
        flags = ["cache.kv_dtype=fp8_e4m3", *VLLM, f"transfer.vllm_kv_cache_dtype={name}"]
        assert load_config(None, env={}, overrides=flags).transfer.vllm_kv_cache_dtype == name
    silent = problems("cache.kv_dtype=fp8_e4m3", *VLLM)
    assert "cache.kv_dtype 'fp8_e4m3' with transfer.vllm_kv_cache_dtype 'auto'" in silent
    wrong = problems(*VLLM, "transfer.vllm_kv_cache_dtype=fp8")
    assert "cache.kv_dtype 'auto' with transfer.vllm_kv_cache_dtype 'fp8'" in wrong
    auto = problems("cache.kv_dtype=fp8_e4m3", *VLLM, "transfer.vllm_kv_cache_dtype=fp8",
                    "model.dtype=auto")  # fmt: skip
    assert "needs an explicit model.dtype" in auto
    assert "vllm_kv_cache_dtype" in problems(*VLLM, "transfer.vllm_kv_cache_dtype=int8")


def test_an_unknown_kv_dtype_is_refused() -> None:
    assert "kv_dtype" in problems("cache.kv_dtype=int8")


def test_a_native_decode_with_a_bf16_pool_is_refused_naming_both_dtypes() -> None:
    ours = KVLayout(2, 2, 8, "fp8_e4m3", 4, 24)
    frame = wire.frame_metadata(b"nixl metadata")

    def refusal(dtype: str):  # type: ignore[no-untyped-def]
        theirs = dataclasses.replace(ours, dtype=dtype, num_pages=100)
        regions = KVRegions(theirs, (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 5 << 20, 8)
        msg = wire.Register.of("decode-1", frame, regions, theirs.compat_hash())
        return check_register(msg, ours, BootstrapLimits())

    assert refusal("fp8_e4m3") is None
    refused = refusal("bfloat16")
    assert refused is not None and refused.reason == RejectReason.LAYOUT_MISMATCH
    assert "dtype='bfloat16'" in refused.message and "dtype='fp8_e4m3'" in refused.message


def test_a_native_decode_with_other_kv_scales_is_refused() -> None:
    """Checkpoint KV scales (``model.quant.kv_scales``) are in the layout hash: a decode that
    reads the FP8 pages with other scales (or none) is refused at registration."""
    ours = KVLayout(2, 2, 8, "fp8_e4m3", 4, 24, kv_scales=(0.5, 0.25, 1.0, 2.0))
    frame = wire.frame_metadata(b"nixl metadata")

    def refusal(scales: tuple[float, ...]):  # type: ignore[no-untyped-def]
        theirs = dataclasses.replace(ours, num_pages=100, kv_scales=scales)
        regions = KVRegions(theirs, (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 5 << 20, 8)
        msg = wire.Register.of("decode-1", frame, regions, theirs.compat_hash())
        return check_register(msg, ours, BootstrapLimits())

    assert refusal((0.5, 0.25, 1.0, 2.0)) is None
    for other in ((), (0.5, 0.25, 2.0, 1.0)):
        refused = refusal(other)
        assert refused is not None and refused.reason == RejectReason.LAYOUT_MISMATCH
        assert "kv_scales=(0.5, 0.25, 1.0, 2.0)" in refused.message
