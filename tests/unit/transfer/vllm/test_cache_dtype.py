"""What vLLM decodes hash for an FP8 pool: their model dtype and their ``kv_cache_dtype``
string apart (``profiles.cache_dtype_refusal``); a worker whose pool they would read as
another dtype refuses to start its vLLM backend, naming both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import KVLayout
from prefill_worker.model.kv_mirror import KVMirror
from prefill_worker.transfer.options import VllmIdentity
from prefill_worker.transfer.vllm.backend import PullRegistration, check_cache_dtype, our_hash
from prefill_worker.transfer.vllm.handshake import CompatFactors, compat_hash
from prefill_worker.transfer.vllm.profiles import PROFILES, cache_dtype_refusal
from prefill_worker.transfer.vllm.staging import StagingLayout, StagingPool


@pytest.mark.parametrize(
    ("cache_dtype", "pool", "model", "served"),
    [
        ("auto", "bfloat16", "bfloat16", True),
        ("fp8", "fp8_e4m3", "bfloat16", True),
        ("fp8_e4m3", "fp8_e4m3", "float32", True),
        ("auto", "fp8_e4m3", "bfloat16", False),
        ("fp8", "bfloat16", "bfloat16", False),
        ("fp8_e5m2", "fp8_e4m3", "bfloat16", False),
    ],
)
def test_which_decodes_read_which_pool(
    cache_dtype: str, pool: str, model: str, served: bool
) -> None:
    assert (cache_dtype_refusal(cache_dtype, pool, model) is None) == served


def test_a_refusal_names_both_dtypes() -> None:
    why = cache_dtype_refusal("auto", "fp8_e4m3", "bfloat16")
    assert why is not None and "hold a bfloat16 cache" in why and "KV pool is fp8_e4m3" in why
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' hold a fp8_e4m3 cache"):
        check_cache_dtype(VllmIdentity("m", cache_dtype="fp8", model_dtype="bfloat16"), "bfloat16")
    with pytest.raises(ValueError, match=r"set model\.dtype"):
        check_cache_dtype(VllmIdentity("m", cache_dtype="fp8"), "fp8_e4m3")
    check_cache_dtype(VllmIdentity("m"), "float32")  # the pool is the model's: served


def test_our_hash_covers_the_model_dtype_and_the_cache_string() -> None:
    lay = StagingLayout(2, 2, 32, 1, 32, 4)
    identity = VllmIdentity("m", "CPU_ATTN", "fp8", "float32")
    registration = PullRegistration("e", b"", (1, 2), lay.block_bytes, 4, 32, 1,
                                    lay, "fp8_e4m3", identity, ("0.34.0",))  # fmt: skip
    want = CompatFactors("m", "float32", 2, 32, 2, "CPU_ATTN", cache_dtype="fp8")
    assert our_hash(registration, "0.34.0") == compat_hash(want.for_profile(PROFILES["0.34.0"]))
    e4m3 = compat_hash(
        CompatFactors("m", "float32", 2, 32, 2, "CPU_ATTN", cache_dtype="fp8_e4m3").for_profile(
            PROFILES["0.34.0"]
        )
    )
    assert our_hash(registration, "0.34.0") != e4m3  # vLLM hashes the string itself
    assert KVLayout(2, 2, 32, "fp8_e4m3", 16, 4).itemsize == lay.itemsize


def test_the_forward_mirrors_fp8_bytes_into_one_byte_staging_blocks() -> None:
    """The runner's KV mirror over an FP8 pool's staging region (1 byte a value): each
    token's K‖V lands at its slot as the pool's bytes."""
    lay = StagingLayout(1, 2, 8, 1, 32, 2)
    staging = StagingPool(lay)
    mirror = KVMirror([staging.layer_view(0)], torch.float8_e4m3fn)
    k, v = (torch.randn(3, 2, 8).to(torch.float8_e4m3fn) for _ in range(2))  # [M, KV, D]
    mirror.write(0, mirror.index_of(np.array([0, 1, 33])), k, v)
    view = torch.from_numpy(staging.layer_view(0))  # [blocks, KV, block_size, 2 D] bytes
    got = torch.stack([view[0, :, 0], view[0, :, 1], view[1, :, 1]])  # [M, KV, 2 D]
    assert torch.equal(got, torch.cat([k, v], dim=-1).view(torch.uint8))
